"""Gradient compression for data-parallel training, as PyTorch DDP communication hooks.

    import netgain.comm
    state = netgain.comm.register(ddp_model, codec="gqsgd", bits=8)   # Global-QSGD, packed
    ... train ...; state.last_step  # wire bytes, timings of the last step
"""

from .codecs import CODEC_NAMES, Codec, make_codec, time_codec
from .hooks import CommState, NonFiniteGradientError, PlanMismatchError, hook, register

__all__ = ["CODEC_NAMES", "Codec", "CommState", "NonFiniteGradientError", "PlanMismatchError",
           "hook", "make_codec", "register", "time_codec"]
