"""A saved compressed model says what it is: plain transformers refuses it by its model type; after
`import netgain.align`, AutoModelForCausalLM loads and generates with it exactly as netgain.align.load."""

import json
import subprocess
import sys

import pytest
import torch

from netgain.align import AlignConfig, ASVDConfig, PrunerConfig, SVDLLMConfig, compress, load
from netgain.align.store import MANIFEST
from test_align import batches, tiny

METHODS = {"asvd": ASVDConfig(), "svdllm": SVDLLMConfig(), "prune": PrunerConfig(scope="global")}
MODEL_TYPES = {"asvd": "netgain_lowrank", "svdllm": "netgain_lowrank", "prune": "netgain_pruned"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved tiny Llama per compressor: method -> folder."""
    folders = {}
    for method, compressor in METHODS.items():
        model, result = compress(tiny("llama"), batches(), AlignConfig(compressor, param_ratio=0.7, cost="a100"))
        folders[method] = result.save(model, tmp_path_factory.mktemp(method) / "out")
    return folders


def fresh_python(script: str, *args) -> str:
    """stdout of `script` in a new interpreter (nothing of this process's imports or registrations)."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_config_names_a_netgain_architecture_wrapping_the_base(saved):
    for method, folder in saved.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == MODEL_TYPES[method]
        assert config["base_config"]["model_type"] == "llama" and config["compressed_modules"]


PLAIN = """
import sys
from transformers import AutoModelForCausalLM
for folder in sys.argv[1:]:
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        print("loaded")
    except ValueError as error:
        print("refused:", str(error).splitlines()[0])
assert not any(name.startswith("netgain") for name in sys.modules)
"""


def test_plain_transformers_refuses_the_folder_by_its_model_type(saved):
    lines = fresh_python(PLAIN, *saved.values()).splitlines()
    for method, line in zip(saved, lines):
        assert line.startswith("refused:") and f"model type `{MODEL_TYPES[method]}`" in line, line


REGISTERED = """
import sys
import torch
from transformers import AutoModelForCausalLM
import netgain.align

ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
for folder in sys.argv[1:]:
    model, reference = AutoModelForCausalLM.from_pretrained(folder), netgain.align.load(folder)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 15) and torch.equal(generated, reference.generate(ids, max_new_tokens=3, do_sample=False))
    print(type(model).__name__, sum(p.numel() for p in model.parameters()))
"""


def test_after_import_auto_classes_load_and_generate_as_netgain_load(saved):
    lines = fresh_python(REGISTERED, *saved.values()).splitlines()
    for folder, line in zip(saved.values(), lines):
        name, params = line.split()
        reference = load(folder)
        assert name == type(reference).__name__ == "LlamaForCausalLM"
        assert int(params) == sum(p.numel() for p in reference.parameters())


def test_a_folder_written_before_the_model_type_still_loads(saved, tmp_path):
    """Format netgain-align/1: config.json was the base config, the modules were listed in the manifest."""
    folder = saved["asvd"]
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (old / "config.json").write_text(json.dumps(config["base_config"]))
    manifest = {**json.loads((folder / MANIFEST).read_text()), "format": "netgain-align/1", "modules": config["compressed_modules"]}
    (old / MANIFEST).write_text(json.dumps(manifest))
    (old / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(load(old)(ids).logits, load(folder)(ids).logits)
