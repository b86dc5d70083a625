"""Gradient compression for data-parallel training, as PyTorch DDP communication hooks.

    import netgain.comm
    from netgain.comm import GlobalQSGDConfig
    state = netgain.comm.register(ddp_model)                              # auto: the fastest route per bucket
    state = netgain.comm.register(ddp_model, GlobalQSGDConfig(bits=8))   # Global-QSGD, packed
    ... train ...; state.last_step  # wire bytes, timings of the last step
"""

from . import baselines
from .adaptive import MODES as ADAPTIVE_MODES, AdaptivePlanner
from .calibrate import codec_profile, time_codec
from .codecs import Codec
from .config import (CODEC_NAMES, AutoConfig, FIXED_CODEC_NAMES, CastConfig, CommConfig, GlobalQSGDConfig, GlobalQSGDExpConfig,
                     KimadConfig, LowRankConfig, NoCompressionConfig, QSGDConfig, RandomKConfig, TopKConfig,
                     codec_config, comm_config, default_warmup_steps, make_codec)
from .hooks import CommState, NonFiniteGradientError, PlanMismatchError, hook, register

__all__ = ["ADAPTIVE_MODES", "AdaptivePlanner", "AutoConfig", "CODEC_NAMES", "FIXED_CODEC_NAMES", "CastConfig", "Codec",
           "CommConfig", "CommState", "GlobalQSGDConfig", "GlobalQSGDExpConfig", "KimadConfig", "LowRankConfig",
           "NoCompressionConfig", "NonFiniteGradientError", "PlanMismatchError", "QSGDConfig", "RandomKConfig",
           "TopKConfig", "codec_config", "codec_profile", "comm_config", "default_warmup_steps", "hook",
           "make_codec", "register", "time_codec"]
