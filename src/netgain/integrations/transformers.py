"""A Hugging Face TrainerCallback that registers the netgain hook on the Trainer's DDP model.

    trainer = Trainer(model, args, train_dataset=...)
    netgain.integrations.transformers.register(trainer, GlobalQSGDConfig(bits=8))
    trainer.train()                          # or trainer.train(resume_from_checkpoint=True or "path")

The Trainer has no comm-hook option, and its callbacks see only the unwrapped model, so the
callback holds the Trainer and registers on `trainer.model_wrapped` (the DDP after prepare) at
train begin. Each checkpoint folder gets `netgain_comm.pt` (every rank's state, written by rank 0).
The Trainer tells its callbacks no checkpoint path, so the callback notes the one `trainer.train`
is given, and a resumed run reads the state back from that folder with `weights_only=True`.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import comm
from ..comm import CommConfig, CommState

FILENAME = "netgain_comm.pt"


class NetgainCallback(TrainerCallback):
    """Register at train begin, save with each checkpoint, restore on resume, close at train end."""

    def __init__(self, trainer: Trainer, config: "CommConfig | str" = "gqsgd", **options):
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.config = comm.comm_config(config, **options)
        self.state: CommState | None = None
        self.resume_from_checkpoint: str | bool | None = None  # what trainer.train was last given
        trainer.train = self._noting_resume(trainer.train)

    def _noting_resume(self, train):
        @functools.wraps(train)
        def noted(resume_from_checkpoint=None, *args, **kwargs):
            self.resume_from_checkpoint = resume_from_checkpoint
            return train(resume_from_checkpoint, *args, **kwargs)
        return noted

    def resumed_folder(self, args, state) -> str:
        """The checkpoint the Trainer resumed from: the path train() was given; with True, as the Trainer does, the
        last one under output_dir; not known (train called around this callback's note): checkpoint-<step> there."""
        if isinstance(self.resume_from_checkpoint, (str, os.PathLike)):
            return os.fspath(self.resume_from_checkpoint)
        if self.resume_from_checkpoint is True:
            return get_last_checkpoint(args.output_dir)
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"the netgain hook needs the Trainer's model in DistributedDataParallel: launch with "
                            f"torchrun --nproc-per-node 2 train.py; trainer.model_wrapped is "
                            f"{type(model).__name__} (args.parallel_mode={args.parallel_mode})")
        self.state = comm.register(model, self.config)
        if state.global_step > 0:
            folder = self.resumed_folder(args, state)
            path = os.path.join(folder, FILENAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming from {folder} at step {state.global_step}, but it holds no {FILENAME}: "
                                        "it was saved without the netgain callback, or resume with "
                                        "trainer.train(resume_from_checkpoint=<the checkpoint folder>) on this Trainer")
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
