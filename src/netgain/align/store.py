"""Save a compressed HF causal LM as config + safetensors + a manifest; load it back; export it dense.

config.json says what the folder is (`netgain.align.hf`: model_type `netgain_lowrank` or
`netgain_pruned`, wrapping the base config and naming every replaced module with its `spec()`).
manifest.json records how it was made (method, variant, ratio, sizes, dtype). Loading rebuilds the
base architecture, swaps each named module for the kind its spec records, checked against the
Linear it replaces (so a hostile spec cannot allocate more than the dense layer), then loads the
weights strictly. Folders written before model_type said so (format netgain-align/1: the base config,
the modules in the manifest) still load. Compressors add their module kinds to `MODULE_KINDS`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from .hf import CompressedConfig, compressed_config
from .lowrank import LowRankLinear
from .prune import PrunedLinear

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
FORMAT = "netgain-align/2"
FORMATS = ("netgain-align/1", FORMAT)  # /1: config.json claimed the base architecture; the modules were in the manifest
DTYPES = ("float32", "bfloat16", "float16")
# manifest "kind" -> the module class, built by its from_spec
MODULE_KINDS = {"lowrank": LowRankLinear, "linear": PrunedLinear}


def save(model: nn.Module, out_dir: str | Path, tokenizer=None, **metadata) -> Path:
    """Write config.json, model.safetensors and manifest.json (plus generation config and tokenizer)."""
    modules = {name: m.spec() for name, m in model.named_modules() if hasattr(m, "spec")}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    manifest = {"format": FORMAT, "architecture": type(model).__name__, "dtype": dtype, **metadata}

    def write(folder: Path) -> None:
        compressed_config(model.config, modules).save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
        save_model(model, str(folder / WEIGHTS))
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return write_folder(out_dir, write)


def write_folder(out_dir: str | Path, write: Callable[[Path], object]) -> Path:
    """Have `write` fill a fresh folder inside `out_dir`, then move each file into `out_dir` with
    os.replace: an existing name is re-pointed, never written through, so a hard link or symlink
    left in `out_dir` cannot carry the write into another model's files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".netgain-") as tmp:
        write(Path(tmp))
        for file in Path(tmp).iterdir():
            os.replace(file, out / file.name)
    return out


def manifest(directory: str | Path) -> dict | None:
    """The manifest of a folder netgain wrote, None for any other folder."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("format") in FORMATS else None


def compressed_modules(directory: str | Path) -> dict[str, dict]:
    """Module name -> spec of every module netgain replaced in a saved folder (empty for a plain model)."""
    from transformers import AutoConfig

    record = manifest(directory)
    if record is None:
        return {}
    if record["format"] == FORMAT:
        config = AutoConfig.from_pretrained(directory)
        return dict(config.compressed_modules or {}) if isinstance(config, CompressedConfig) else {}
    return dict(record.get("modules") or {})


def load(directory: str | Path, dtype: str | torch.dtype | None = None, device=None) -> nn.Module:
    """Rebuild a model saved by `save` (eval mode; in its saved dtype unless `dtype`; on `device`)."""
    from transformers import AutoConfig

    directory = Path(directory)
    record = manifest(directory)
    if record is None:
        raise FileNotFoundError(f"{directory / MANIFEST} not found or not a {FORMAT} manifest: not a directory written "
                                "by netgain.align.save")
    config = AutoConfig.from_pretrained(directory)
    base = config.base() if isinstance(config, CompressedConfig) else config
    if dtype is None:
        dtype = record.get("dtype")
        if dtype not in DTYPES:
            raise ValueError(f"{directory / MANIFEST}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model = build(base, compressed_modules(directory), dtype)
    load_model(model, str(directory / WEIGHTS), strict=True)
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.to(device).eval() if device is not None else model.eval()


def build(base, modules: Mapping[str, Mapping], dtype: str | torch.dtype | None = None) -> nn.Module:
    """The base architecture (uninitialised weights are the caller's to load) with every listed module
    replaced by the kind its spec records."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_config(base, dtype=dtype)
    for name, spec in modules.items():
        module = replacement(model, name, spec)
        model.set_submodule(name, module.to(dtype) if dtype is not None else module)
    return model


def replacement(model: nn.Module, name, spec) -> nn.Module:
    """The module a spec records for `name`, refused unless it replaces a Linear of `model` and is no
    larger than it (checked before anything is allocated)."""
    try:
        original = model.get_submodule(name) if isinstance(name, str) and name else None
    except AttributeError:  # no such module
        original = None
    if not isinstance(original, nn.Linear):
        raise ValueError(f"compressed module {name!r}: not a Linear of {type(model).__name__}")
    if not isinstance(spec, Mapping) or spec.get("kind") not in MODULE_KINDS:
        raise ValueError(f"compressed module {name}: kind must be one of {sorted(MODULE_KINDS)}, got "
                         f"{spec.get('kind') if isinstance(spec, Mapping) else spec!r}")
    for key, largest in (("in_features", original.in_features), ("out_features", original.out_features)):
        value = spec.get(key)
        if type(value) is not int or not 1 <= value <= largest:
            raise ValueError(f"compressed module {name}: {key} must be an integer in [1, {largest}], got {value!r}")
    if not isinstance(spec.get("bias"), bool):
        raise ValueError(f"compressed module {name}: bias must be true or false, got {spec.get('bias')!r}")
    return MODULE_KINDS[spec["kind"]].from_spec(spec)



def export_dense(directory: str | Path, out_dir: str | Path) -> nn.Module:
    """Write a plain transformers folder that computes the same function at full size, for engines that
    know only dense layers: every factorised Linear multiplied back, every pruned one zero-filled to
    its original shape. It gives up the size: the folder holds the dense parameter count. Returns
    the dense model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load(directory)
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(model.config)  # the base's Linears, full size
    for name in compressed_modules(directory):
        model.set_submodule(name, dense_linear(model.get_submodule(name), shapes.get_submodule(name)))
    tokenizer = AutoTokenizer.from_pretrained(directory) if (Path(directory) / "tokenizer_config.json").is_file() else None

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    write_folder(out_dir, write)
    return model


@torch.no_grad()
def dense_linear(module: nn.Module, original: nn.Linear) -> nn.Linear:
    """A compressed module as a Linear of `original`'s shape: factors multiplied back (in float32), and
    zeros where pruning removed channels. Pruning packs the kept channels first in every Linear of a
    block alike, so the zeros line up: a removed MLP channel or KV group contributes nothing."""
    outer = module.up if isinstance(module, LowRankLinear) else module
    weight = module.up.weight.float() @ module.down.weight.float() if isinstance(module, LowRankLinear) else module.weight
    dense = nn.Linear(original.in_features, original.out_features, bias=outer.bias is not None,
                      device=outer.weight.device, dtype=outer.weight.dtype)
    dense.weight.zero_()
    dense.weight[: weight.shape[0], : weight.shape[1]] = weight
    if outer.bias is not None:
        dense.bias.zero_()
        dense.bias[: outer.bias.shape[0]] = outer.bias
    return dense
