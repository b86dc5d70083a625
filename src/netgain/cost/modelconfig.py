"""A Hugging Face model folder's config, and its model built on the meta device (shapes, no weights), read
safely: config.json only as a regular file of bounded size, its layer counts bounded before the build (the
build is per layer: 10 million layers took minutes), and any way transformers fails one ValueError naming
the flag."""

from __future__ import annotations

from pathlib import Path

from netgain.files import require_regular_file

CONFIG_MAX_BYTES = 16 << 20  # real config.json files are a few kB
MAX_LAYERS = 10_000  # the deepest published LLMs have a few hundred


def load_config(folder: str | Path, flag: str):
    """The transformers config of ``folder``'s config.json."""
    from transformers import AutoConfig

    require_regular_file(Path(folder) / "config.json", flag, CONFIG_MAX_BYTES)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # OSError, ValueError, huggingface_hub's validation errors, ...
        raise ValueError(f"{flag} {folder}: its config.json does not load ({error})") from error
    _check_layers(config.to_dict(), flag, folder)
    return config


def _check_layers(config: dict, flag: str, folder) -> None:
    """Every layer count of a config (num_hidden_layers, n_layer, a text_config's ...) at most MAX_LAYERS."""
    for key, value in config.items():
        if isinstance(value, dict):
            _check_layers(value, flag, folder)
        elif "layer" in str(key) and isinstance(value, int) and value > MAX_LAYERS:
            raise ValueError(f"{flag} {folder}: config.json's {key}={value} is more layers than netgain models "
                             f"(at most {MAX_LAYERS:,})")


def meta_model(config, flag: str, causal_lm: bool = False):
    """The model of ``config`` on the meta device: a causal LM, else (unless ``causal_lm``) the bare model."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config)
            except ValueError:
                if causal_lm:
                    raise
                return AutoModel.from_config(config)
    except Exception as error:  # sizes past int64 (RuntimeError), negative sizes, unknown architectures, ...
        raise ValueError(f"{flag}: transformers cannot build a model of its config.json ({error})") from error
