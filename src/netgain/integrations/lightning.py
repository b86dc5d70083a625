"""A Lightning Callback that registers the netgain hook after the DDP wrap, on every device.

    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                                callbacks=[NetgainDDP(GlobalQSGDConfig(bits=8))])

`DDPStrategy(ddp_comm_hook=...)` registers only when the root device is CUDA, silently nothing
on CPU; this Callback registers in `on_fit_start`, when `trainer.strategy.model` is the DDP.
Lightning restores callback state before that wrap, so a loaded state waits until registering.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

from .. import comm
from ..comm import CommConfig, CommState


class NetgainDDP(Callback):
    """Register `netgain.comm.register(ddp, config)` at fit start; checkpoint its state; close it at teardown.

    ``config``: what `netgain.comm.register` takes (a codec config, a CommConfig, or a codec name
    with keywords). `state` is the CommState during fit (its `history` holds per-step statistics).
    """

    def __init__(self, config: "CommConfig | str" = "gqsgd", **options):
        self.config = comm.comm_config(config, **options)  # validated now, not at fit start
        self.state: CommState | None = None
        self._live = False                  # registered on this fit's DDP, not yet torn down
        self._loaded: dict | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"NetgainDDP needs a DistributedDataParallel model: Trainer(strategy='ddp' or "
                            f"'ddp_spawn', devices>=2 or num_nodes>=2); trainer.strategy.model is "
                            f"{type(model).__name__} under {type(trainer.strategy).__name__}")
        self.state, self._live = comm.register(model, self.config), True
        if self._loaded is not None:
            self.state.load_state_dict(self._loaded)
            self._loaded = None

    def state_dict(self) -> dict:
        """Every rank's codec state (collective: Lightning calls it on every rank; rank 0's file holds all)."""
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self._live:
            self.state.load_state_dict(state_dict)
        else:
            self._loaded = state_dict  # restored before the DDP wrap: applied once registered

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.state is not None:
            self.state.close()
        self._live = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A failed fit skips `teardown`: drain the thread before the process group goes (e.g. after NaN)."""
        self.teardown(trainer, pl_module, "fit")
