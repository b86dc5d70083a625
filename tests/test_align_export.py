"""`netgain align export --dense`, hostile saved specs, and output folders that must not overwrite a model."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from netgain.align import AlignConfig, ASVDConfig, PrunerConfig, cli, compress, load
from netgain.align.lowrank import LowRankLinear
from netgain.align.prune import PrunedLinear
from test_align import batches, tiny
from test_align_cli import TEXT, parse, run_align, tiny_model_dir

COMPRESSORS = {"asvd": ASVDConfig(), "prune": PrunerConfig(scope="global")}


@pytest.fixture(scope="module", params=sorted(COMPRESSORS))
def saved(request, tmp_path_factory):
    """A tiny Gemma-3 (biasless, GQA with one KV head) or Qwen2 (q/k/v biases) compressed and saved."""
    arch = "qwen2" if request.param == "prune" else "gemma3"
    model, result = compress(tiny(arch), batches(), AlignConfig(COMPRESSORS[request.param], param_ratio=0.7, cost="a100"))
    return result.save(model, tmp_path_factory.mktemp(request.param) / "out")


def test_dense_export_is_a_plain_full_size_model_of_the_same_function(saved, tmp_path, capsys):
    assert cli.run(parse("export", "--model", str(saved), "--dense", str(tmp_path / "dense"))) == 0
    assert "gives up" in capsys.readouterr().out
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert config["model_type"] in ("gemma3_text", "qwen2") and not (tmp_path / "dense" / "manifest.json").exists()
    compressed = load(saved)
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()  # plain transformers: no netgain type
    assert not any(isinstance(m, (LowRankLinear, PrunedLinear)) for m in dense.modules())
    assert sum(p.numel() for p in dense.parameters()) > sum(p.numel() for p in compressed.parameters())
    ids = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, compressed(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change,message", [
    (lambda spec: spec.update(rank=10**9), "rank must be an integer in"),
    (lambda spec: spec.update(rank=1e9), "rank must be an integer in"),
    (lambda spec: spec.update(in_features=10**9), "in_features must be an integer in"),
    (lambda spec: spec.update(bias="yes"), "bias must be"),
    (lambda spec: spec.update(kind="script"), "kind must be one of"),
])
def test_a_hostile_spec_is_refused_before_anything_is_allocated(tmp_path, change, message):
    folder = hostile_copy(tmp_path, lambda modules: change(next(s for s in modules.values() if s["kind"] == "lowrank")))
    with pytest.raises(ValueError, match=message):
        load(folder)


@pytest.mark.parametrize("name", ["", "../../../etc/passwd", "model.layers.0.mlp", "model.layers.9.mlp.up_proj"])
def test_a_spec_naming_no_linear_of_the_model_is_refused(tmp_path, name):
    folder = hostile_copy(tmp_path, lambda modules: modules.update({name: next(iter(modules.values()))}))
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="not a Linear of"):
        load(folder)
    assert sorted(p for p in tmp_path.rglob("*")) == before


def hostile_copy(tmp_path, change):
    """A saved low-rank tiny Llama whose config.json's compressed_modules were edited by `change`."""
    model, result = compress(tiny("llama"), batches(), AlignConfig(ASVDConfig(), param_ratio=0.7, cost="a100"))
    folder = result.save(model, tmp_path / "saved")
    config = json.loads((folder / "config.json").read_text())
    change(config["compressed_modules"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_out_holding_another_model_is_refused_and_left_alone(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "model")
    other = tiny_model_dir(tmp_path / "other")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(SystemExit, match="holds files netgain did not write"):
        cli.run(parse("--model", str(model_dir), "--out", str(other), "--cost", "a100"))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_out_reaching_model_through_a_symlink_is_refused(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "model")
    (tmp_path / "link").symlink_to(model_dir)
    for out in (tmp_path / "link", tmp_path / "link" / "sub"):
        with pytest.raises(SystemExit, match="is --model .* or inside it"):
            cli.run(parse("--model", str(model_dir), "--out", str(out), "--cost", "a100"))


def test_an_earlier_output_with_hard_links_to_model_is_rewritten_without_touching_model(tmp_path):
    """--out a hard-linked copy of --model (a pruned netgain output): saving replaces the links, never writes through."""
    run_align(tmp_path / "first", "--method", "prune", "--variants", "gac")
    source = tmp_path / "first" / "out"
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in source.iterdir():
        os.link(file, copy / file.name)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    run_align(tmp_path / "second", "--model", str(source), "--out", str(copy), "--method", "asvd", "--variants", "gac")
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert any(isinstance(m, LowRankLinear) for m in load(copy).modules())


def test_an_output_whose_weights_do_not_load_is_named_in_one_line(tmp_path):
    folder = hostile_copy(tmp_path, lambda modules: None)
    (folder / "model.safetensors").write_bytes(b"\x10\x00")  # a SafetensorError traceback before
    with pytest.raises(SystemExit, match="--model .*saved: cannot load it"):
        cli.run(parse("export", "--model", str(folder), "--dense", str(tmp_path / "dense")))
