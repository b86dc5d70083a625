"""Gradient compression for data-parallel training, as PyTorch DDP communication hooks.

    import netgain.comm
    state = netgain.comm.register(ddp_model, codec="gqsgd", bits=8)   # Global-QSGD, packed
    ... train ...; state.last_step  # wire bytes, timings of the last step
"""

from . import baselines
from .adaptive import MODES as ADAPTIVE_MODES, AdaptivePlanner
from .codecs import CODEC_NAMES as FIXED_CODEC_NAMES, Codec, make_codec, time_codec
from .hooks import CommState, NonFiniteGradientError, PlanMismatchError, hook, register

CODEC_NAMES = FIXED_CODEC_NAMES + ADAPTIVE_MODES  # everything `register(codec=...)` takes

__all__ = ["ADAPTIVE_MODES", "AdaptivePlanner", "CODEC_NAMES", "FIXED_CODEC_NAMES", "Codec", "CommState", "NonFiniteGradientError", "PlanMismatchError",
           "hook", "make_codec", "register", "time_codec"]
