"""Per-parameter state of the hook, keyed by parameter name, independent of DDP's buckets.

`BucketLayout` is what the pipeline learns about one DDP bucket, once per layout (DDP rebuilds
its buckets after the first step): the parameters' names and spans, the Segments table of the
fused codecs, the 1-D spans sent exact (skip_1d), and the codecs' own index tables.

`StateStore` holds what persists across steps: EF21 buffers, or low rank's residual and warm
start (the codec's `memory`). They live flat per bucket layout,
and the store keeps a view per parameter name, so a new layout takes them over parameter by
parameter and a checkpoint names parameters, not buckets. Randomness is counter-based (fused.py),
so no RNG state exists to store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .feedback import EF21, LowRankMemory
from .fused import Segments, name_key

FORMAT = "netgain.comm/2"


@dataclass
class BucketLayout:
    names: list[str]
    spans: list[tuple[int, int]]             # (offset, numel) of each parameter in the flat buffer
    segments: Segments
    exact_index: torch.Tensor | None = None  # elements of the parameters sent exact (skip_1d)
    tables: dict = field(default_factory=dict)
    feedback: "EF21 | LowRankMemory | None" = None
    shapes: list[tuple[int, ...]] | None = None  # each parameter's shape (low-rank codecs need it)

    @classmethod
    def of(cls, bucket: dist.GradBucket, name_of, skip_1d: bool) -> "BucketLayout":
        buffer = bucket.buffer()
        base, size = buffer.data_ptr(), buffer.element_size()
        entries = sorted(((g.data_ptr() - base) // size, g.numel(), name_of(p), p.dim() <= 1, tuple(p.shape))
                         for p, g in zip(bucket.parameters(), bucket.gradients()) if p.numel())  # 0 elements: nothing to send
        names = [name for _, _, name, _, _ in entries]
        spans = [(offset, numel) for offset, numel, _, _, _ in entries]
        if sum(numel for _, numel in spans) != buffer.numel():
            raise RuntimeError(f"bucket {bucket.index()}: its parameters do not tile its buffer (a DDP layout netgain does not know)")
        segments = Segments.build([numel for _, numel in spans], [name_key(n) for n in names], buffer.device)
        exact = [torch.arange(o, o + k, device=buffer.device) for o, k, _, flat, _ in entries if flat] if skip_1d else []
        return cls(names, spans, segments, torch.cat(exact) if exact else None,
                   shapes=[shape for *_, shape in entries])


class StateStore:
    def __init__(self):
        self.views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # name -> (local g_i, shared g)
        self.loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # from a checkpoint, not yet placed

    def feedback_for(self, layout: BucketLayout, device, codec) -> "EF21 | LowRankMemory":
        """The layout's state buffers (``codec.memory``: EF21's, or low rank's residual and warm start),
        taking over each parameter's values from an earlier layout or a checkpoint."""
        if layout.feedback is None:
            feedback, shared_spans = codec.memory(layout, device)
            for name, (offset, numel), (at, size) in zip(layout.names, layout.spans, shared_spans):
                previous = self.views.get(name) or self.loaded.pop(name, None)
                local, shared = feedback.local[offset:offset + numel], feedback.shared[at:at + size]
                if previous is not None:
                    if (previous[0].numel(), previous[1].numel()) != (numel, size):
                        raise ValueError(f"the comm state loaded holds {previous[0].numel()} values for parameter "
                                         f"{name}, which has {numel} here: it is another model's")
                    local.copy_(previous[0].reshape(-1))
                    shared.copy_(previous[1].reshape(-1))
                else:
                    codec.fill_shared(name, shared)
                self.views[name] = (local, shared)
            layout.feedback = feedback
        return layout.feedback

    def local_state(self) -> dict[str, torch.Tensor]:
        return {name: local.detach().cpu().clone() for name, (local, _) in sorted(self.views.items())}

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {name: shared.detach().cpu().clone() for name, (_, shared) in sorted(self.views.items())}

    def load(self, local: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> None:
        self.views = {}
        self.loaded = {name: (local[name], shared[name]) for name in shared}
