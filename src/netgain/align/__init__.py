"""GPU-aligned compression of LLMs (GAC): a compressor proposes sizes, GAC re-selects aligned ones, save/load rebuilds.

    from netgain.align import AlignConfig, SVDLLMConfig, compress
    model, report = compress(model, calib_batches, AlignConfig(SVDLLMConfig(), param_ratio=0.85, cost="a100"))
"""

from ..cost.profile import MeasuredCost
from .config import AlignConfig, ASVDConfig, PrunerConfig, SVDLLMConfig
from .pipeline import Compression, compress
from .store import load, save

__all__ = ["compress", "Compression", "AlignConfig", "ASVDConfig", "SVDLLMConfig", "PrunerConfig", "MeasuredCost", "load", "save"]
