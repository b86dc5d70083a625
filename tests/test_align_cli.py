"""`netgain align` end to end on a tiny random Llama with a character-level tokenizer."""

import argparse
import json
import math
import os
import pickle
import statistics
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from netgain.align import cli, evaluate, load
from netgain.align.lowrank import LowRankLinear
from netgain.align.prune import PrunedLinear

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40


def tiny_model_dir(path):
    chars = sorted(set(TEXT))
    vocab = {c: i for i, c in enumerate(["<unk>"] + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(vocab),
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def run_align(tmp_path, *extra: str) -> dict:
    """`netgain align` on a tiny model with small calibration/eval settings (plus `extra` flags); its report.json."""
    model_dir = tiny_model_dir(tmp_path / "model")
    (tmp_path / "calib.txt").write_text(TEXT)
    (tmp_path / "eval.txt").write_text(TEXT[::-1])
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args([
        "--model", str(model_dir), "--calib", str(tmp_path / "calib.txt"), "--eval", str(tmp_path / "eval.txt"),
        "--out", str(tmp_path / "out"), "--param-ratio", "0.8", "--cost", "a100", "--calib-seqs", "2",
        "--calib-len", "32", "--eval-chunks", "2", "--seq", "32", "--repeats", "1", *extra,
    ])
    assert cli.run(args) == 0
    return json.loads((Path(args.out) / "report.json").read_text())


def test_align_cli_reports_all_variants_and_saves_gac(tmp_path):
    report = run_align(tmp_path)
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["dense", "raw", "round-nearest", "round-down", "gac"]
    assert rows["gac"]["aligned_8"] == 1.0 and rows["round-down"]["aligned_8"] == 1.0
    assert rows["gac"]["unit_params"] <= report["budget"] == rows["raw"]["unit_params"]
    # round-down keeps the budget except where a rank below 8 goes up to 8 (tiny layers here)
    assert rows["round-down"]["unit_params"] <= report["budget"] or min(report["sizes"]["raw"].values()) < 8
    assert set(rows["gac"]["predicted"]) == {"a100", "h100"}
    quality, latency = (tmp_path / "out" / "report.md").read_text().split("\n\nQuality")[1].split("\nLatency")
    for table, columns in ((quality, 6), (latency, 4 + 2)):  # a readable width: the latency table's + a100, h100
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert [line.split(" | ")[0] for line in lines[2:]] == [f"| {v}" for v in rows]
        assert all(line.count("|") == columns + 1 for line in lines)
    assert "| perplexity | vs dense |" in quality and "| measured prefill ms ± spread (vs dense) |" in latency
    model = load(tmp_path / "out")
    ranks = {n: m.rank for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    assert ranks and all(r % 8 == 0 for r in ranks.values())
    assert all(report["sizes"]["gac"][n] == r for n, r in ranks.items())


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("inside", ["", "sub/dir"])
def test_out_inside_model_is_refused_before_anything_is_written(tmp_path, inside):
    model_dir = tiny_model_dir(tmp_path / "model")
    before = sorted(p.name for p in model_dir.iterdir())
    (tmp_path / "calib.txt").write_text(TEXT)
    args = parse("--model", str(model_dir), "--out", str(model_dir / inside), "--calib", str(tmp_path / "calib.txt"),
                 "--eval", str(tmp_path / "calib.txt"), "--cost", "a100")
    with pytest.raises(SystemExit, match="is --model .* or inside it"):
        cli.run(args)
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_model_must_be_a_local_hugging_face_directory(tmp_path):
    with pytest.raises(SystemExit, match="no such directory"):
        cli.run(parse("--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--cost", "a100"))
    with pytest.raises(SystemExit, match="--model '': no such directory"):  # was taken as the current directory
        cli.run(parse("--model", "", "--out", str(tmp_path / "out"), "--cost", "a100"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        cli.run(parse("--model", str(tmp_path / "plain"), "--out", str(tmp_path / "out"), "--cost", "a100"))


@pytest.mark.parametrize("method", ["asvd", "prune"])
def test_align_cli_runs_every_method(tmp_path, method):
    report = run_align(tmp_path, "--method", method, "--variants", "raw,gac")
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["gac"]["aligned_8"] == 1.0 and rows["gac"]["unit_params"] <= report["budget"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["method"] == method


def test_align_cli_with_kernels_measured_here(tmp_path):
    report = run_align(tmp_path, "--cost", "measured", "--cache", str(tmp_path / "kernels.json"), "--variants", "raw,gac")
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["gac"]["aligned_8"] == 1.0 and rows["gac"]["unit_params"] <= report["budget"]
    assert (tmp_path / "kernels.json").exists()


def test_align_cli_checks_gac_on_held_out_calibration_text(tmp_path):
    """The report's GAC / round-down ratio, recomputed from the two saved models on the calibration text
    after the calibration's own sequences: the check ran on that text, and on the model that was saved."""
    report = run_align(tmp_path, "--check-seqs", "2")
    (tmp_path / "round-down").mkdir()
    round_down = run_align(tmp_path / "round-down", "--check-seqs", "2", "--save", "round-down", "--variants", "round-down")
    check = report["check"]
    # on this tiny model GAC's sizes differ from round-down's and beat them (by 0.05%), so the saved gac is GAC's own
    assert not check["same_as_round_down"] and check["kept"]
    assert report["sizes"]["gac"] != round_down["sizes"]["round-down"] == report["sizes"]["round-down"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    held_out = evaluate.token_chunks(tokenizer, TEXT, 32, 2 + 2)[2:]  # --calib-len 32; after --calib-seqs 2
    gac_losses = evaluate.chunk_losses(load(tmp_path / "out"), held_out)
    round_down_losses = evaluate.chunk_losses(load(tmp_path / "round-down" / "out"), held_out)
    ratio = math.exp(statistics.mean(gac_losses) - statistics.mean(round_down_losses))
    assert ratio == pytest.approx(check["ratio"], rel=1e-5)
    assert check["low"] <= ratio <= check["high"] and ratio < 1
    assert f"{check['ratio']:.4f}" in report["summary"] and "GAC kept" in report["summary"]


def test_negative_check_seqs_is_refused_before_loading(tmp_path):
    args = parse("--out", str(tmp_path / "out"), "--check-seqs", "-1", "--cost", "a100")
    with pytest.raises(SystemExit, match="--check-seqs must be 0"):
        cli.run(args)


@pytest.mark.parametrize("flags, message", [
    (["--calib-seqs", "0"], "--calib-seqs must be at least 1, got 0"),
    (["--calib-len", "0"], "--calib-len must be at least 2, got 0"),
    (["--eval-chunks", "0"], "--eval-chunks must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--threads", "-1"], "--threads must be at least 1, got -1"),
    (["--threads", str(10**30)], r"--threads must be at most \d+, got 1000000"),  # overflowed in torch
    (["--repeats", str(10**30)], "--repeats must be at most 1000"),  # timed for ever
])
def test_bad_count_is_named_before_loading(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        cli.run(parse("--out", str(tmp_path / "out"), "--cost", "a100", *flags))


def test_bad_paths_are_named_before_compressing(tmp_path):
    model = str(tiny_model_dir(tmp_path / "model"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("a user's file")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "fifos").mkdir()
    os.mkfifo(tmp_path / "fifos" / "a.txt")
    out = ["--out", str(tmp_path / "out")]
    for argv, message in (
        ([*out, "--calib", str(tmp_path / "missing.txt")], "--calib .*missing.txt: No such file"),
        ([*out, "--calib", str(tmp_path / "empty")], "--calib .*empty: no [*].txt files"),
        ([*out, "--eval", str(tmp_path / "missing.txt")], "--eval .*missing.txt: No such file"),
        ([*out, "--calib", str(tmp_path / "fifo")], "--calib .*fifo is a FIFO"),  # blocked for ever
        ([*out, "--eval", "/dev/zero"], "--eval /dev/zero is a character device"),  # never ended
        ([*out, "--calib", str(tmp_path / "fifos")], "--calib .*a.txt is a FIFO"),
        (["--out", str(tmp_path / "file")], "is an existing file, not a directory"),
        (["--out", str(tmp_path / "file" / "sub")], "file is an existing file, not a directory"),
        ([*out, "--eval", ""], "--eval is empty"),
        (["--out", ""], "--out is required"),
        (["--out", "/proc/self/out"], "--out /proc/self/out: cannot write in /proc/self"),  # failed after compressing
            ([], "--out is required"),
        ([*out, "--cost", "measured", "--cache", str(tmp_path / "empty")], "cache .*empty is a folder, not a regular file"),
    ):
        with pytest.raises((SystemExit, ValueError), match=message):
            cli.run(parse("--model", model, "--cost", "a100", "--calib", str(tmp_path / "file"), *argv))
    assert (tmp_path / "file").read_text() == "a user's file" and not (tmp_path / "out").exists()


def test_a_pruned_output_is_compressed_again_from_its_real_layers_and_counted_as_it_is(tmp_path):
    """`netgain align --model <pruned output>` factorises its pruned Linears; `netgain model --model` counts
    the parameters the folder really holds; a low-rank output is refused by name before it loads."""
    from netgain.cost.advise import count_parameters

    run_align(tmp_path / "first", "--method", "prune", "--scope", "global", "--variants", "gac")
    pruned = tmp_path / "first" / "out"
    report = run_align(tmp_path / "second", "--model", str(pruned), "--method", "asvd", "--variants", "dense,gac")
    assert report["rows"][0]["model_params"] == sum(p.numel() for p in load(pruned).parameters())
    source = load(pruned)
    factorised = {n: m for n, m in load(tmp_path / "second" / "out").named_modules() if isinstance(m, LowRankLinear)}
    assert any(isinstance(source.get_submodule(n), PrunedLinear) for n in factorised)
    for name, module in factorised.items():  # each factorises the pruned Linear at its real shape
        assert (module.in_features, module.out_features) == (source.get_submodule(name).in_features,
                                                             source.get_submodule(name).out_features)
    for folder in (pruned, tmp_path / "second" / "out"):
        counted = sum(math.prod(shape) for shape in count_parameters(str(folder)))
        assert counted == sum(p.numel() for p in load(folder).parameters())
    with pytest.raises(SystemExit, match="netgain low-rank model"):
        run_align(tmp_path / "third", "--model", str(tmp_path / "second" / "out"))


@pytest.mark.parametrize("edit, message", [
    (lambda config: "{garbage", "its config.json does not load"),
    (lambda config: json.dumps({**json.loads(config), "num_hidden_layers": 10**7}), "more layers than netgain models"),  # built for minutes
    (lambda config: json.dumps({**json.loads(config), "hidden_size": 128}), "cannot load it"),  # a traceback
])
def test_a_model_folder_that_does_not_load_is_named_in_one_line(tmp_path, edit, message):
    model = tiny_model_dir(tmp_path / "model")
    (model / "config.json").write_text(edit((model / "config.json").read_text()))
    with pytest.raises((ValueError, SystemExit), match=message):
        cli.run(parse("--model", str(model), "--out", str(tmp_path / "out"), "--cost", "a100",
                      "--calib", str(model / "config.json"), "--eval", str(model / "config.json")))


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name, weights", [("model.safetensors", lambda marker: b"\x10\x00"),
                                           ("pytorch_model.bin", lambda marker: pickle.dumps(RunsCode(marker)))])
def test_weights_that_do_not_load_are_named_in_one_line_and_run_nothing(tmp_path, name, weights):
    model = tiny_model_dir(tmp_path / "model")
    (model / "model.safetensors").unlink()
    (model / name).write_bytes(weights(tmp_path / "code-ran"))  # tracebacks before
    with pytest.raises(SystemExit, match="cannot load it"):
        cli.run(parse("--model", str(model), "--out", str(tmp_path / "out"), "--cost", "a100",
                      "--calib", str(model / "config.json"), "--eval", str(model / "config.json")))
    assert not (tmp_path / "code-ran").exists()
