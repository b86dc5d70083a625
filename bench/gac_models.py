"""Models and text for the GAC benchmarks: a Llama-3-8B-shaped latency model, the held-out corpora
(KJV Bible, CPython standard library source) and a second calibration domain (GCIDE, Webster 1913). Gemma-3-270M and the Python docs come from
`netgain.align.defaults` (the CLI's embedded default).

    python bench/gac_models.py      # convert the packaged Gemma-3-270M once into the user cache
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def kjv_text() -> str:
    """The King James Bible, from the Debian packages bible-kjv and bible-kjv-text."""
    try:
        return subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as error:
        raise SystemExit("the KJV corpus needs: apt-get install -y --no-install-recommends bible-kjv bible-kjv-text") from error


def stdlib_text(limit: int = 2_000_000) -> str:
    """The first `limit` characters of the CPython standard library's *.py files (sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(p for p in root.glob("*.py")):
        parts.append(path.read_text(errors="replace"))
        size += len(parts[-1])
        if size >= limit:
            break
    return "\n\n".join(parts)[:limit]


def gcide_text(limit: int = 2_000_000) -> str:
    """The first `limit` characters of the GCIDE dictionary (Webster 1913), from the Debian package dict-gcide."""
    import gzip

    path = Path("/usr/share/dictd/gcide.dict.dz")
    if not path.exists():
        raise SystemExit("the GCIDE corpus needs: apt-get install -y --no-install-recommends dict-gcide")
    with gzip.open(path, "rt", errors="replace") as f:
        return f.read(limit)


if __name__ == "__main__":
    from netgain.align.defaults import packaged_gemma

    print(packaged_gemma())
