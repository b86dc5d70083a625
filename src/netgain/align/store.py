"""Save a compressed HF causal LM as config + safetensors + a manifest of replaced modules; load it back.

The base architecture is rebuilt from config.json, every module named in manifest.json is swapped
for the kind of module it records (its `spec()`), then the weights load strictly. Compressors add
their module kinds to `MODULE_KINDS`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from .lowrank import LowRankLinear
from .prune import PrunedLinear

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
FORMAT = "netgain-align/1"
# manifest "kind" -> constructor from the module's spec
MODULE_KINDS = {"lowrank": LowRankLinear.from_spec, "linear": PrunedLinear.from_spec}


def save(model: nn.Module, out_dir: str | Path, tokenizer=None, **metadata) -> Path:
    """Write config.json, model.safetensors and manifest.json (plus the tokenizer when given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    save_model(model, str(out / WEIGHTS))
    modules = {name: m.spec() for name, m in model.named_modules() if hasattr(m, "spec")}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    manifest = {"format": FORMAT, "architecture": type(model).__name__, "dtype": dtype, "modules": modules, **metadata}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load(directory: str | Path) -> nn.Module:
    """Rebuild a model saved by `save` (eval mode, the dtype it was saved in)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if not (directory / MANIFEST).exists():
        raise FileNotFoundError(f"{directory / MANIFEST} not found: not a directory written by netgain.align.save")
    manifest = json.loads((directory / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"unsupported manifest format {manifest.get('format')!r}; expected {FORMAT!r}")
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, manifest["dtype"]))
    for name, spec in manifest["modules"].items():
        if spec["kind"] not in MODULE_KINDS:
            raise ValueError(f"module {name}: unknown kind {spec['kind']!r}; known: {sorted(MODULE_KINDS)}")
        model.set_submodule(name, MODULE_KINDS[spec["kind"]](spec).to(getattr(torch, manifest["dtype"])))
    load_model(model, str(directory / WEIGHTS), strict=True)
    return model.eval()
