"""GPU-aligned compression of LLMs (GAC): a compressor proposes sizes, GAC re-selects aligned ones, save/load rebuilds.

    from netgain.align import AlignConfig, SVDLLMConfig, compress
    model, report = compress(model, calib_batches, AlignConfig(SVDLLMConfig(), param_ratio=0.85, cost="a100"))

Importing it registers netgain's saved model types with transformers' Auto classes (`hf.register`), so
`AutoModelForCausalLM.from_pretrained(folder)` loads a compressed model as `load(folder)` does.
"""

from ..cost.profile import MeasuredCost
from . import hf
from .config import AlignConfig, ASVDConfig, PrunerConfig, SVDLLMConfig
from .pipeline import Compression, compress
from .store import load, save

hf.register()

__all__ = ["compress", "Compression", "AlignConfig", "ASVDConfig", "SVDLLMConfig", "PrunerConfig", "MeasuredCost", "load", "save"]
