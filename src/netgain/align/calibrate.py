"""The calibration pass compressors share: backward of the LM loss over calibration batches."""

from __future__ import annotations

import torch
from torch import nn


def loss_backward(model: nn.Module, batches, trainable: frozenset[int] = frozenset(), progress=None) -> int:
    """Run the next-token loss backward on every batch (token ids used as labels); returns the batch count.

    Only the parameters whose id() is in `trainable` accumulate .grad (gradients w.r.t. activations
    still flow to any hooks); requires_grad is restored afterwards.
    """
    flags = {p: p.requires_grad for p in model.parameters()}
    seen = 0
    try:
        for p in flags:
            p.requires_grad_(id(p) in trainable)
        with torch.enable_grad():
            for ids in batches:
                ids = ids.to(model.device)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                seen += 1
                if progress is not None:
                    progress.update(1)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return seen
