"""netgain's compressed models as transformers architectures, so a saved folder says what it is.

The config.json that `netgain.align.save` writes has model_type `netgain_lowrank` (factorised Linears,
possibly over pruned ones) or `netgain_pruned` (pruned Linears only). It wraps the base model's
config (`base_config`) and names every module netgain replaced (`compressed_modules`, name -> spec).
Plain transformers refuses such a folder ("does not recognize this architecture") rather than
building the base model and initialising the compressed layers at random.

`import netgain.align` registers both types with AutoConfig and AutoModelForCausalLM (no remote
code). `AutoModelForCausalLM.from_pretrained(folder)` then returns what `netgain.align.load` returns:
the base architecture's own class (a LlamaForCausalLM, a Gemma3ForCausalLM) with the compressed
modules in place, so `generate`, the KV cache and the rest are the base model's own.
"""

from __future__ import annotations

from typing import Mapping

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

# AutoModelForCausalLM's hub options: a saved netgain model is a local folder and needs none of them
HUB_OPTIONS = frozenset({"cache_dir", "force_download", "local_files_only", "proxies", "subfolder", "_from_auto", "token",
                         "revision", "trust_remote_code", "adapter_kwargs", "code_revision"})


class CompressedConfig(PreTrainedConfig):
    """The base model's config and the modules netgain replaced in it."""

    base_config: dict | None = None  # the base model's config.json
    compressed_modules: dict | None = None  # module name -> the spec of the module that replaces it

    def base(self) -> PreTrainedConfig:
        """The base model's config, as transformers builds it."""
        if not isinstance(self.base_config, Mapping) or "model_type" not in self.base_config:
            raise ValueError(f"{self.model_type} config: base_config must be the base model's config with its model_type")
        return AutoConfig.for_model(**self.base_config)


class LowRankConfig(CompressedConfig):
    model_type = "netgain_lowrank"


class PrunedConfig(CompressedConfig):
    model_type = "netgain_pruned"


def compressed_config(base: PreTrainedConfig, modules: Mapping[str, Mapping]) -> PreTrainedConfig:
    """The config a model with these replaced modules is saved with: low-rank if any module is
    factorised, pruned otherwise; the base config itself when nothing was replaced (plain
    transformers then loads it correctly)."""
    if not modules:
        return base
    kinds = {spec["kind"] for spec in modules.values()}
    cls = LowRankConfig if "lowrank" in kinds else PrunedConfig
    return cls(base_config=base.to_dict(), compressed_modules=dict(modules), architectures=[MODELS[cls].__name__])


class CompressedForCausalLM:
    """What AutoModelForCausalLM builds for a netgain config: an instance of the base architecture's
    class with the compressed modules (`netgain.align.store`), not a wrapper around it."""

    config_class = CompressedConfig

    @classmethod
    def from_pretrained(cls, directory, *args, config=None, dtype=None, torch_dtype=None, device_map=None, **options):
        """`netgain.align.load(directory)`; dtype ("auto" or None: as saved) and device_map (one device) are honoured."""
        from .store import load

        unknown = sorted(set(options) - HUB_OPTIONS)
        if args or unknown:
            raise ValueError(f"a netgain compressed model takes dtype and device_map (one device); got "
                             f"{', '.join(unknown) or f'{len(args)} positional arguments'}")
        dtype = dtype if dtype is not None else torch_dtype
        return load(directory, dtype=None if dtype == "auto" else dtype, device=device_map)

    @classmethod
    def _from_config(cls, config: CompressedConfig, dtype=None, torch_dtype=None, **options):
        """The architecture without weights (what `AutoModelForCausalLM.from_config` builds, on the meta
        device for counting parameters)."""
        from .store import build

        return build(config.base(), config.compressed_modules or {}, dtype if dtype is not None else torch_dtype)


class LowRankForCausalLM(CompressedForCausalLM):
    config_class = LowRankConfig


class PrunedForCausalLM(CompressedForCausalLM):
    config_class = PrunedConfig


MODELS = {LowRankConfig: LowRankForCausalLM, PrunedConfig: PrunedForCausalLM}


def register() -> None:
    """Teach AutoConfig and AutoModelForCausalLM netgain's model types (idempotent)."""
    for config, model in MODELS.items():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
