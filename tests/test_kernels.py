"""Kernel and whole-model latency: the analytic GPU model against the paper's A100 rows, robust timing,
the measured cost table (atomic, corruption-safe), the end-to-end latency model and `netgain profile`."""

import argparse
import dataclasses
import json
import os
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from netgain.align import gac
from netgain.align.lowrank import LowRankUnit
from netgain.cost import latency, measured, profile, published
from netgain.cost.kernels import GPUS, AnalyticCost, gemm_tier
from netgain.cost.measured import CACHE_FORMAT, MeasuredCost
from netgain.cost.profile import linear_shapes, rank_sweep
from netgain.cost.timing import Timing, interleaved, summarise


def test_gemm_tiers_follow_alignment_of_k_and_n():
    assert gemm_tier(4096, 112) == "native"
    assert gemm_tier(4104, 112) == "native-k8"
    assert gemm_tier(4096, 106) == "align2"
    assert gemm_tier(4096, 107) == "align1"


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_misaligned_rank_is_slower_than_a_larger_aligned_one(gpu):
    cost = AnalyticCost(gpu)
    for tokens in (1, 1024):
        # rank 107 vs 112 (the paper's example): the smaller, odd rank costs more
        odd = cost.gemm(tokens, 4096, 107) + cost.gemm(tokens, 107, 4096)
        aligned = cost.gemm(tokens, 4096, 112) + cost.gemm(tokens, 112, 4096)
        assert odd > aligned


def test_wave_quantisation_makes_a_step():
    cost = AnalyticCost("a100")
    # 4096 x N with 256x128 tiles: 16 row tiles; 108 SMs -> the 7th column tile starts a second wave,
    # so 1/6 more columns cost far more than 1/6 more time
    assert cost.gemm(4096, 4096, 7 * 128) > 1.4 * cost.gemm(4096, 4096, 6 * 128)


def test_sdpa_falls_back_to_math_kernel_when_head_dim_not_multiple_of_8():
    cost = AnalyticCost("h100")
    assert cost.sdpa(1, 32, 1024, 1024, 100) > 2 * cost.sdpa(1, 32, 1024, 1024, 128)
    # 136 is a multiple of 8 but pads to the 160 template
    assert cost.sdpa(1, 32, 1024, 1024, 136) == pytest.approx(cost.sdpa(1, 32, 1024, 1024, 160))


def test_analytic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gpu must be one of"):
        AnalyticCost("v100")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        AnalyticCost("a100").gemm(1, 0, 8)


@pytest.fixture(scope="module")
def paper_rows():
    """Every published row at the length its authors' script timed, and the figure's S=512 bars."""
    cost = AnalyticCost("a100")
    at = lambda name, seq: latency.predict(published.variant(name), cost, seq, seq, logits=seq).total_s * 1e3
    rows = {name: at(name, published.PAPER_SEQ_LEN[name]) for name in published.PAPER_A100_MS}
    return rows, {name: at(name, 512) for name in published.FIGURE_A100_MS_S512}


@pytest.mark.parametrize("row", list(published.PAPER_A100_MS))
def test_analytic_a100_matches_the_papers_rows_within_15_percent(paper_rows, row):
    assert paper_rows[0][row] == pytest.approx(published.PAPER_A100_MS[row], rel=0.15)


@pytest.mark.parametrize("row", list(published.FIGURE_A100_MS_S512))
def test_analytic_a100_matches_the_papers_s512_bars_within_15_percent(paper_rows, row):
    assert paper_rows[1][row] == pytest.approx(published.FIGURE_A100_MS_S512[row], rel=0.15)


def test_asvd_rows_are_timed_at_512_not_1024():
    """At S=1024 (the paper's text) ASVD+GAC would need its 85% of dense's GEMM FLOPs to run faster per FLOP
    than dense's own GEMMs: every GEMM at dense's seconds per FLOP is still > 15% over the published row."""
    cost = AnalyticCost("a100")
    parts = {n: latency.predict(published.variant(n), cost, 1024, 1024, logits=1024) for n in ("dense", "asvd+gac")}
    flops = {n: sum(2 * 1024 * u.in_features * u.out_features for u in published.variant(n).modules() if isinstance(u, torch.nn.Linear))
             for n in parts}
    dense = parts["dense"]
    bound = (dense.total_s - dense.gemm_s + dense.gemm_s * flops["asvd+gac"] / flops["dense"]) / dense.total_s
    assert bound * published.PAPER_A100_MS["dense"] > 1.15 * published.PAPER_A100_MS["asvd+gac"]
    assert published.PAPER_SEQ_LEN["asvd"] == published.PAPER_SEQ_LEN["asvd+gac"] == 512


def test_published_variants_have_the_papers_budget_and_alignment():
    dense, pruner, asvd = (published.variant(n) for n in ("dense", "llm-pruner", "asvd"))
    linears = lambda m: [x for x in m.model.layers.modules() if isinstance(x, torch.nn.Linear)]
    params = lambda m: sum(x.in_features * x.out_features for x in linears(m))
    assert params(pruner) / params(dense) == pytest.approx(0.85, abs=0.005)
    assert params(asvd) / params(dense) == pytest.approx(0.85, abs=0.005)
    assert published.aligned_fraction(pruner) == pytest.approx(0.83, abs=0.03)  # the paper: 83%
    ranks = list(published.asvd_ranks(dense).values())
    assert sum(r % 8 == 0 for r in ranks) / len(ranks) < 0.1  # the paper: 5%
    with pytest.raises(ValueError, match="name must be one of"):
        published.variant("asvd+round")


def test_outliers_are_rejected_and_the_spread_reported():
    t = summarise([1.0, 1.01, 0.99, 1.02, 0.98, 5.0])
    assert t.rejected == 1 and t.kept == 5 and t.median_s == pytest.approx(1.0)
    assert 0 < t.spread < 0.05 and t.times_s[-1] == 5.0
    assert summarise([2.0, 2.0, 2.0]).spread == 0.0
    with pytest.raises(ValueError, match="at least one sample"):
        summarise([])


def test_interleaved_rounds_rotate_the_order():
    order = []
    calls = {k: (lambda k=k: order.append(k)) for k in "abc"}
    timed = interleaved(calls, repeats=3, warmup=0, before={"b": lambda: order.append("reset")})
    assert [k for k in order if k != "reset"] == list("abcbcacab") and all(len(t.times_s) == 3 for t in timed.values())
    assert all(order[i + 1] == "b" for i, k in enumerate(order) if k == "reset")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved(calls, repeats=0)


@pytest.fixture
def undisturbed(monkeypatch):
    """Every real timing counts as undisturbed, whatever the machine's load: these tests are about the cache."""
    monkeypatch.setattr(measured, "DISTURBED_SPREAD", float("inf"))
    monkeypatch.setattr(measured, "DISTURBED_LOAD", float("inf"))


def test_measured_cost_times_once_and_reloads_from_cache(tmp_path, monkeypatch, undisturbed):
    path = tmp_path / "table.json"
    cost = MeasuredCost("cpu", "float32", warmup=1, repeats=3, cache=path)
    t = cost.gemm(16, 32, 24)
    a = cost.sdpa(1, 2, 8, 8, 16)
    assert t > 0 and a > 0 and 0 <= cost.noise
    cost.save()
    record = json.loads(path.read_text())
    assert record["device"] == cost.name and record["threads"] == torch.get_num_threads()
    entry = record["entries"]["gemm 16 32 24"]
    assert len(entry["times_s"]) == 3 and {"median_s", "spread", "kept", "rejected"} <= set(entry)

    reloaded = MeasuredCost("cpu", "float32", cache=path)
    monkeypatch.setattr(reloaded, "_time", lambda calls, cold: pytest.fail("cached shape was measured again"))
    assert reloaded.gemm(16, 32, 24) == t
    assert reloaded.sdpa(1, 2, 8, 8, 16) == a


def test_cache_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    cost = MeasuredCost("cpu", "float32", warmup=0, repeats=1, cache=path)
    cost.gemm(4, 8, 8)
    cost.save()
    before = path.read_text()
    cost.gemm(4, 8, 16)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        cost.save()
    assert path.read_text() == before  # the old table survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]  # and no temp file is left behind


def test_a_netgain_table_with_unreadable_entries_is_measured_again_and_rewritten(tmp_path):
    path = tmp_path / "table.json"
    name = MeasuredCost("cpu", "float32", cache=tmp_path / "other.json").name
    path.write_text(json.dumps({"format": CACHE_FORMAT, "device": name, "dtype": "float32", "entries": {"gemm 1 1 1": {}}}))
    with pytest.warns(UserWarning, match="unreadable entries"):
        cost = MeasuredCost("cpu", "float32", warmup=0, repeats=1, cache=path)
    assert cost.table == {}
    cost.gemm(4, 8, 8)
    cost.save()
    assert "gemm 4 8 8" in json.loads(path.read_text())["entries"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_measured_cost_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be one of"):
        MeasuredCost("cpu", "int8")
    with pytest.raises(ValueError, match="device must be"):
        MeasuredCost("tpu")
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        MeasuredCost("cpu", threads=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            MeasuredCost("cuda")


@pytest.mark.parametrize("content", ["a user's notes", "", "[1, 2]", '{"device": "x", "dtype": "float32", "mine": 1}',
                                     '{"device": "cpu:x", "entries": {'])
def test_a_cache_path_holding_no_netgain_table_is_refused_and_left_alone(tmp_path, content):
    """netgain recognises its tables by their format field: it moves and writes over no other file (an older
    notes.txt.corrupt included)."""
    path, aside = tmp_path / "notes.txt", tmp_path / "notes.txt.corrupt"
    path.write_text(content)
    aside.write_text("older notes")
    with pytest.raises(ValueError, match="is not a netgain kernel table, and netgain writes over no other file"):
        MeasuredCost("cpu", cache=path)
    assert path.read_text() == content and aside.read_text() == "older notes"


def test_a_cache_path_that_is_no_regular_file_or_cannot_be_made_is_refused_before_measuring(tmp_path):
    with pytest.raises(ValueError, match="is a folder, not a regular file"):
        MeasuredCost("cpu", cache=tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"is a FIFO \(named pipe\), not a regular file"):  # read, it would block
        MeasuredCost("cpu", cache=tmp_path / "fifo")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot make its folder"):
        MeasuredCost("cpu", cache=tmp_path / "file" / "table.json")


def test_a_table_written_before_the_format_field_is_still_read(tmp_path):
    path = tmp_path / "table.json"
    cost = MeasuredCost("cpu", "float32", warmup=0, repeats=1, cache=path)
    cost.gemm(4, 8, 8)
    record = json.loads(cost.save().read_text())
    del record["format"]
    path.write_text(json.dumps(record))
    assert "gemm 4 8 8" in MeasuredCost("cpu", "float32", cache=path).table


def tiny_llama_config():
    return LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    )


class Counting:
    """A cost model that charges 1 s per call of each kind and records what it was asked."""

    host_bound = True

    def __init__(self):
        self.asked = []

    def __getattr__(self, kind):
        return lambda *args: self.asked.append((kind, args)) or 1.0


def test_predicted_latency_counts_kernels_and_every_overhead():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    cost = Counting()
    parts = latency.predict(model, cost, 8, 8)
    kinds = [k for k, _ in cost.asked]
    assert kinds.count("gemm") == 2 * 7 + 1 and kinds.count("sdpa") == 2
    assert kinds.count("norm") == 2 * 2 + 1 and kinds.count("activation") == 2  # two norms a layer + the final one
    assert parts.glue_s > 0 and parts.framework_s > 0 and parts.overhead_s == pytest.approx(parts.total_s - 2 * 7 - 1 - 2)
    (calls, ops), = [args for k, args in cost.asked if k == "framework"]
    assert calls > 2 * 10 and ops > 0  # module calls and the ops outside the timed kernels
    decode = Counting()
    latency.predict(model, decode, 1, 9)
    assert ("sdpa", (1, 4, 1, 9, 16)) in decode.asked
    assert ("elementwise", (2 * 9 * 2 * 16, 1)) in decode.asked  # the KV cache append
    with pytest.raises(ValueError, match="tokens <= context"):
        latency.predict(model, cost, 8, 4)


def test_a_kernels_only_cost_model_predicts_kernels_alone():
    class Kernels:
        def gemm(self, m, k, n):
            return 1.0

        def sdpa(self, *args):
            return 0.0

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    parts = latency.predict(model, Kernels(), 8, 8)
    assert parts.total_s == parts.gemm_s == 2 * 7 + 1


def test_a_measured_prediction_is_built_from_the_kernels_timed_here(tmp_path, monkeypatch, undisturbed):
    """End to end on this CPU, with no timing race: every part of a real model's prediction comes from a
    timed entry, and the saved table alone gives the same prediction again (how close a prediction is to
    the measured latency is bench/gac_latency.py's question)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    cost = MeasuredCost("cpu", "float32", warmup=1, repeats=3, cache=tmp_path / "t.json")
    prefill, decode = latency.predict(model, cost, 32, 32), latency.predict(model, cost, 1, 33)
    for parts in (prefill, decode):
        assert all(seconds > 0 for seconds in dataclasses.asdict(parts).values()), parts  # nothing left unpriced
    cost.save()
    reloaded = MeasuredCost("cpu", "float32", cache=tmp_path / "t.json")
    monkeypatch.setattr(reloaded, "_time", lambda calls, cold: pytest.fail("the prediction needed a kernel the table lacks"))
    assert latency.predict(model, reloaded, 32, 32) == prefill and latency.predict(model, reloaded, 1, 33) == decode


def test_linear_shapes_and_rank_sweep():
    assert linear_shapes(tiny_llama_config()) == [(64, 32), (64, 64), (64, 96), (96, 64)]
    # 64 x 96: dense size 6144 = rank 38.4 x (64 + 96); ranks 24..38 at ratio 0.6..1.0, step 8
    assert rank_sweep(64, 96, 8, 0.6, 1.0) == [16, 24, 32]


def test_profile_cli_writes_a_table(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path / "model")
    path = tmp_path / "table.json"
    parser = argparse.ArgumentParser()
    profile.configure(parser)
    rc = profile.run(parser.parse_args(["--model", str(tmp_path / "model"), "--seq", "16", "--repeats", "1", "--warmup", "0", "--cache", str(path)]))
    assert rc == 0
    entries = json.loads(path.read_text())["entries"]
    assert "gemm 16 64 96" in entries and "gemm 1 96 64" in entries and "sdpa 1 4 16 16 16 1" in entries
    assert any(k.startswith("norm LlamaRMSNorm") for k in entries) and "call" in entries and "op" in entries
    with pytest.raises(ValueError, match="--min-ratio"):
        profile.run(parser.parse_args(["--model", str(tmp_path / "model"), "--min-ratio", "0"]))
    with pytest.raises(ValueError, match="--model .*nothing/config.json: No such file or directory"):
        profile.run(parser.parse_args(["--model", str(tmp_path / "nothing")]))


@pytest.mark.parametrize("argv, message", [
    (["--seq", "100000000"], "--seq 100000000 is longer than the model's context (max_position_embeddings=2048)"),
    (["--repeats", "1000000000"], "--repeats must be at most 1000"),
    (["--warmup", "1000000000"], "--warmup must be at most 1000"),
    (["--threads", "100000"], "--threads must be at most this machine's"),
    (["--max-ratio", "inf"], "0 < min <= max <= 2 (full rank of a square layer)"),
    (["--max-ratio", "nan"], "0 < min <= max <= 2"),
])
def test_profile_refuses_sizes_and_rounds_no_run_could_finish(tmp_path, argv, message):
    """Each of these ran for hours, crashed torch (100,000 threads) or overflowed range(); refused before any timing."""
    tiny_llama_config().save_pretrained(tmp_path / "model")
    parser = argparse.ArgumentParser()
    profile.configure(parser)
    with pytest.raises(ValueError, match=re.escape(message)):
        profile.run(parser.parse_args(["--model", str(tmp_path / "model"), "--cache", str(tmp_path / "t.json"), *argv]))
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("change, message", [({"num_hidden_layers": 10_000_000}, "is more layers than netgain models"),
                                             ({"hidden_size": 1 << 40, "intermediate_size": 1 << 41}, "transformers cannot build"),
                                             ({"hidden_size": 1 << 20, "num_attention_heads": 1 << 14}, "largest GEMM holds"),
                                             ({"hidden_size": "big"}, "its config.json does not load")])
def test_profile_refuses_a_config_it_cannot_build_or_time(tmp_path, change, message):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**tiny_llama_config().to_dict(), **change}))
    parser = argparse.ArgumentParser()
    profile.configure(parser)
    with pytest.raises(ValueError, match=message):
        profile.run(parser.parse_args(["--model", str(tmp_path / "model"), "--cache", str(tmp_path / "t.json")]))


@pytest.fixture
def steady_timer(monkeypatch):
    """MeasuredCost's timer replaced by the analytic A100 at a 1% spread on a quiet machine: no timing race."""
    a100 = AnalyticCost("a100")

    def time(self, calls, cold):
        seconds = {key: a100.gemm(*map(int, key.split()[1:])) for key in calls}
        return {key: Timing(t, 0.01, 3, 0, (t, t, t)) for key, t in seconds.items()}

    monkeypatch.setattr(MeasuredCost, "_time", time)
    monkeypatch.setattr(measured, "load_per_core", lambda: 0.1)


@pytest.mark.parametrize("spread,load,remeasured", [(0.5, 0.1, True), (0.01, 4.0, True), (0.01, None, True), (0.01, 0.1, False)])
def test_an_entry_timed_while_disturbed_is_measured_again_before_gac_uses_it(tmp_path, steady_timer, spread, load, remeasured):
    """The GEMMs of GAC's choice cached 50x slower, as a busy moment times them: with a large spread, a
    high load or no load on record they are timed again and GAC's sizes equal a fresh table's; an
    undisturbed record is trusted, and then (the counterfactual) those sizes move."""
    units = [LowRankUnit("u", 29, 64, 1.0, 64, 160), LowRankUnit("v", 47, 64, 0.5, 64, 160)]
    path = tmp_path / "table.json"
    fresh = MeasuredCost("cpu", cache=path)
    sizes = gac.select(units, fresh, 512, multiple=8, steps=2)
    fresh.save()
    record = json.loads(path.read_text())
    slowed = {f"gemm {m} {k} {n}" for m, k, n in units[1].gemms(sizes["v"], 512)}
    for key in slowed:
        entry = record["entries"][key]
        entry.update(median_s=50 * entry["median_s"], spread=spread, load=load)
    path.write_text(json.dumps(record))
    cached = MeasuredCost("cpu", cache=path)
    assert (cached.stale == slowed) == remeasured
    again = gac.select(units, cached, 512, multiple=8, steps=2)
    assert (again == sizes) == remeasured and cached.remeasured == len(slowed) * remeasured
    assert all((cached.table[key].timing.median_s == fresh.table[key].timing.median_s) == remeasured for key in slowed)


def test_refresh_measures_every_entry_again(tmp_path, steady_timer):
    path = tmp_path / "table.json"
    cost = MeasuredCost("cpu", cache=path)
    cost.measure_gemms([(8, 16, 24), (8, 24, 16)])
    cost.save()
    entry = json.loads(path.read_text())["entries"]["gemm 8 16 24"]
    assert entry["load"] == 0.1 and entry["machine"] and entry["date"] and entry["spread"] == 0.01
    assert MeasuredCost("cpu", cache=path).stale == set()
    refreshed = MeasuredCost("cpu", cache=path, refresh=True)
    refreshed.measure_gemms([(8, 16, 24), (8, 24, 16)])
    assert refreshed.remeasured == 2 and "2 re-measured" in refreshed.describe()
