"""A Hugging Face TrainerCallback that registers the netgain hook on the Trainer's DDP model.

    trainer = Trainer(model, args, train_dataset=...)
    netgain.integrations.transformers.register(trainer, GlobalQSGDConfig(bits=8))
    trainer.train()                          # or trainer.train(resume_from_checkpoint=True)

The Trainer has no comm-hook option, and its callbacks see only the unwrapped model, so the
callback holds the Trainer and registers on `trainer.model_wrapped` (the DDP after prepare) at
train begin. Each checkpoint folder gets `netgain_comm.pt` (every rank's state, written by rank 0);
a resumed run (global_step > 0 at train begin) reads it back with `weights_only=True`.
"""

from __future__ import annotations

import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import comm
from ..comm import CommConfig, CommState

FILENAME = "netgain_comm.pt"


class NetgainCallback(TrainerCallback):
    """Register at train begin, save with each checkpoint, restore on resume, close at train end.

    ``resume_from``: the checkpoint folder a resumed run loads the state from (default: the
    Trainer's own ``<output_dir>/checkpoint-<global_step>``, what resume_from_checkpoint=True picks).
    """

    def __init__(self, trainer: Trainer, config: "CommConfig | str" = "gqsgd", *, resume_from: str | None = None,
                 **options):
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.config = comm.comm_config(config, **options)
        self.resume_from = resume_from
        self.state: CommState | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"the netgain hook needs the Trainer's model in DistributedDataParallel: launch with "
                            f"torchrun --nproc-per-node 2 train.py; trainer.model_wrapped is "
                            f"{type(model).__name__} (args.parallel_mode={args.parallel_mode})")
        self.state = comm.register(model, self.config)
        if state.global_step > 0:
            folder = self.resume_from or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            path = os.path.join(folder, FILENAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming at step {state.global_step}, but {path} is missing: pass "
                                        f"resume_from=<the checkpoint folder> to NetgainCallback")
            self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        saved = self.state.state_dict()  # collective: every rank is in on_save
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero or (args.save_on_each_node and state.is_local_process_zero):
            torch.save(saved, os.path.join(folder, FILENAME))

    def on_train_end(self, args, state, control, **kwargs):
        self.state.close()


def register(trainer: Trainer, config: "CommConfig | str" = "gqsgd", **options) -> NetgainCallback:
    """Add a NetgainCallback to ``trainer``; returns it (its `state` is the CommState once training begins)."""
    callback = NetgainCallback(trainer, config, **options)
    trainer.add_callback(callback)
    return callback
