"""LLM-Pruner-style structured pruning of HF causal LMs: MLP channels and whole attention KV groups.

Two kinds of units per decoder layer:
- an MLP's intermediate width (channel j = row j of gate_proj and up_proj plus column j of
  down_proj, removed together);
- an attention block's query width in channels (heads x head_dim), removed a KV group at a time:
  a KV head goes with the query heads that read it, so grouped-query attention keeps a valid
  layout (same heads per group) and head_dim never changes. A block with one KV head is left whole.
Importance per channel / group is the first-order Taylor term |w * dL/dw| summed over the weights
it owns (gradients of the LM loss on calibration text, LLM-Pruner's "element" salience), or |w|.
Sizes follow a parameter ratio over the decoder Linears either uniformly (the same kept fraction in
every unit of a layer range) or by global ranking (lowest salience per parameter goes first).
Pruned Linears are physically smaller `PrunedLinear`s that `netgain.align.load` rebuilds from the
manifest. GAC re-selects the MLP widths (`Pruner.resizable`), valuing a width by the salience it
prunes away; head counts are multiples of head_dim already.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from .calibrate import loss_backward
from .compressor import Compressor
from .phases import bar
from .lowrank import decoder_linears
from .units import Unit, check_propose

IMPORTANCE = ("taylor", "magnitude")
SCOPES = ("uniform", "global")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class PrunedLinear(nn.Linear):
    """A Linear made smaller by pruning; its spec lets `netgain.align.load` build it at that shape."""

    def spec(self) -> dict:
        return {"kind": "linear", "in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: Mapping) -> "PrunedLinear":
        return cls(spec["in_features"], spec["out_features"], bias=spec["bias"])


@dataclass(frozen=True)
class ChannelUnit(Unit):
    """An MLP at intermediate width `size`: gate and up (hidden -> size), down (size -> hidden)."""

    hidden: int
    bias: bool

    def params(self, size: int) -> int:
        return size * (3 * self.hidden + 2 * self.bias)

    def gemms(self, size: int, tokens: int) -> list[tuple[int, int, int]]:
        return [(tokens, self.hidden, size), (tokens, self.hidden, size), (tokens, size, self.hidden)]


@dataclass(frozen=True)
class HeadUnit(Unit):
    """An attention block at `size` query channels (kept KV groups x group x head_dim)."""

    hidden: int
    head_dim: int
    group: int  # query heads per KV head
    bias: bool  # q/k/v biases (Qwen2)

    def kv_channels(self, size: int) -> int:
        return size // self.group

    def params(self, size: int) -> int:
        kv = self.kv_channels(size)
        return self.hidden * (2 * size + 2 * kv) + self.bias * (size + 2 * kv)

    def gemms(self, size: int, tokens: int) -> list[tuple[int, int, int]]:
        kv = self.kv_channels(size)
        return [(tokens, self.hidden, size), (tokens, self.hidden, kv), (tokens, self.hidden, kv), (tokens, size, self.hidden)]


def layer_index(name: str) -> int:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", f"{name}.")
    if match is None:
        raise ValueError(f"module {name!r} is not inside a decoder layer ('layers.<i>.')")
    return int(match.group(1))


def prunable_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Decoder MLPs (gate/up/down) and attention blocks (q/k/v/o), by module name, in model order."""
    blocks = {}
    for name, module in model.named_modules():
        if ".layers." not in f".{name}":
            continue
        if any(all(isinstance(getattr(module, p, None), nn.Linear) for p in projections)
               for projections in (MLP_PROJECTIONS, ATTENTION_PROJECTIONS)):
            blocks[name] = module
    return blocks


def is_attention(block: nn.Module) -> bool:
    return hasattr(block, "q_proj")


def head_layout(block: nn.Module) -> tuple[int, int, int]:
    """(head_dim, query heads, KV heads) of an attention block."""
    head_dim = block.head_dim
    return head_dim, block.q_proj.out_features // head_dim, block.k_proj.out_features // head_dim


def item_salience(block: nn.Module, weight_salience) -> torch.Tensor:
    """Salience of each removable item of a block: MLP channels, or attention KV groups with their query heads."""
    s = {p: weight_salience(getattr(block, p).weight) for p in (ATTENTION_PROJECTIONS if is_attention(block) else MLP_PROJECTIONS)}
    if not is_attention(block):
        return s["gate_proj"].sum(1) + s["up_proj"].sum(1) + s["down_proj"].sum(0)
    head_dim, heads, kv_heads = head_layout(block)
    query = (s["q_proj"].sum(1) + s["o_proj"].sum(0)).reshape(kv_heads, -1).sum(1)
    keys_values = (s["k_proj"].sum(1) + s["v_proj"].sum(1)).reshape(kv_heads, head_dim).sum(1)
    return query + keys_values


def _slice(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> PrunedLinear:
    weight = linear.weight.detach()
    if rows is not None:
        weight = weight[rows]
    if cols is not None:
        weight = weight[:, cols]
    with torch.device("meta"):
        new = PrunedLinear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    new = new.to_empty(device=weight.device).to(weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach() if rows is None else linear.bias.detach()[rows])
    return new


class Pruner(Compressor):
    """Structured pruner (see the module docstring); GAC re-sizes its MLP widths (`resizable`)."""

    method = "prune"

    def __init__(self, importance: str = "taylor", scope: str = "uniform", layers: range | None = None, heads: bool = True):
        if importance not in IMPORTANCE:
            raise ValueError(f"importance must be one of {IMPORTANCE}, got {importance!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        super().__init__()
        self.importance, self.scope, self.layers, self.heads = importance, scope, layers, heads
        self.salience: dict[str, torch.Tensor] = {}  # unit name -> salience per item (channel or KV group)
        self.ranking: dict[str, torch.return_types.sort] = {}  # unit name -> salience sorted high to low, and its items
        self.shapes: dict[str, dict] = {}  # unit name -> what its Unit needs
        self.fixed_params = 0  # decoder Linear parameters outside every unit (e.g. attention with one KV head)

    def fit(self, model: nn.Module, batches, progress: bool = False) -> None:
        """Score every prunable item: Taylor needs the LM loss's gradients on the calibration batches."""
        blocks = {
            name: block
            for name, block in prunable_blocks(model).items()
            if not is_attention(block) or (self.heads and head_layout(block)[2] > 1)
        }
        if not blocks:
            raise ValueError("model has no prunable MLP (gate/up/down_proj) or attention (q/k/v/o_proj) in '.layers.'")
        count = 1 + max(layer_index(name) for name in blocks)
        if self.layers is not None and self.layers.stop > count:  # 0:100 on 2 layers was taken as 0:2
            raise ValueError(f"layers {self.layers.start}:{self.layers.stop} reaches past the model's {count} decoder "
                             f"layers (0:{count} is all of them)")
        if self.importance == "taylor":
            self._accumulate_gradients(model, blocks, batches, progress)
            weight_salience = lambda w: (w.detach().float() * w.grad.float()).abs()
        else:
            weight_salience = lambda w: w.detach().float().abs()
        try:
            for name, block in blocks.items():
                self.salience[name] = item_salience(block, weight_salience).double().cpu()
                self.ranking[name] = torch.sort(self.salience[name], descending=True, stable=True)
                self.shapes[name] = self._shape(block)
        finally:
            model.zero_grad(set_to_none=True)
        linears = sum(p.numel() for m in decoder_linears(model).values() for p in m.parameters())
        self.fixed_params = linears - sum(self._unit(n, s["full"]).params(s["full"]) for n, s in self.shapes.items())

    def _accumulate_gradients(self, model, blocks, batches, progress) -> None:
        # gradients for the projection weights only (none for embeddings / LM head: memory)
        weights = frozenset(id(getattr(b, p).weight) for b in blocks.values() for p in ATTENTION_PROJECTIONS + MLP_PROJECTIONS if hasattr(b, p))
        model.zero_grad(set_to_none=True)
        batches = list(batches)
        with self.phases.timed("forward/backward passes"), bar(len(batches), "calibration passes", progress) as passes:
            seen = loss_backward(model, batches, weights, passes)
        if not seen:
            raise ValueError("Taylor importance needs calibration batches; none were given")

    @staticmethod
    def _shape(block: nn.Module) -> dict:
        if is_attention(block):
            head_dim, heads, kv_heads = head_layout(block)
            hidden = block.q_proj.in_features
            return {"kind": "heads", "hidden": hidden, "head_dim": head_dim, "group": heads // kv_heads,
                    "full": heads * head_dim, "item": (heads // kv_heads) * head_dim, "bias": block.q_proj.bias is not None}
        return {"kind": "channels", "hidden": block.gate_proj.in_features, "full": block.gate_proj.out_features,
                "item": 1, "bias": block.gate_proj.bias is not None}

    def _unit(self, name: str, size: int, error: tuple[float, ...] = ()) -> Unit:
        """A unit with no linear score: GAC values MLP widths by `error` and never re-sizes heads."""
        s = self.shapes[name]
        if s["kind"] == "heads":
            return HeadUnit(name, size, s["full"], 0.0, s["hidden"], s["head_dim"], s["group"], s["bias"])
        return ChannelUnit(name, size, s["full"], 0.0, s["hidden"], s["bias"], error=error)

    def _in_range(self, name: str) -> bool:
        return self.layers is None or layer_index(name) in self.layers

    def propose(self, param_ratio: float) -> list[Unit]:
        """Sizes keeping `param_ratio` of the decoder Linears' parameters (as ASVD counts them); MLP units carry
        the salience pruned at every width, by which GAC values them."""
        check_propose(bool(self.salience), param_ratio)
        names = list(self.salience)
        full = {n: self._unit(n, self.shapes[n]["full"]) for n in names}
        dense = self.fixed_params + sum(u.params(u.full) for u in full.values())
        budget = param_ratio * dense
        prunable = [n for n in names if self._in_range(n)]
        fixed = dense - sum(full[n].params(full[n].full) for n in prunable)
        items = {n: len(self.salience[n]) for n in prunable}
        floor = fixed + sum(full[n].params(self.shapes[n]["item"]) for n in prunable)
        if floor > budget:
            raise ValueError(f"param_ratio {param_ratio} needs more than one item per unit removed in the layer range")
        kept = self._uniform(full, items, fixed, budget) if self.scope == "uniform" else self._global(full, items, fixed, budget)
        units = []
        for n in names:
            count = kept.get(n, len(self.salience[n]))
            units.append(self._unit(n, count * self.shapes[n]["item"], error=self._removed(n)))
        return units

    def _params(self, full, kept: Mapping[str, int], fixed: int) -> int:
        return fixed + sum(full[n].params(k * self.shapes[n]["item"]) for n, k in kept.items())

    def _uniform(self, full, items, fixed, budget) -> dict[str, int]:
        """The largest common kept fraction (per unit, rounded to whole items) within the budget."""
        at = lambda f: {n: min(c, max(1, round(c * f))) for n, c in items.items()}
        low, high = 0.0, 1.0
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if self._params(full, at(mid), fixed) <= budget else (low, mid)
        return at(low)

    def _global(self, full, items, fixed, budget) -> dict[str, int]:
        """Remove items in order of salience per parameter across all units (each keeps at least one)."""
        kept = dict(items)
        per_item = {n: full[n].params(self.shapes[n]["item"]) for n in items}
        candidates = sorted(
            (float(s) / per_item[n], n) for n in items for s in self.ranking[n].values[1:]
        )
        params = self._params(full, kept, fixed)
        for _, n in candidates:
            if params <= budget:
                break
            kept[n] -= 1
            params -= per_item[n]
        return kept

    def _removed(self, name: str) -> tuple[float, ...]:
        """MLP units: the salience pruned away at every width 0..full (GAC values widths by it); heads: none."""
        if self.shapes[name]["kind"] != "channels":
            return ()
        ordered = self.ranking[name].values
        kept = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)])
        return tuple((kept[-1] - kept).tolist())

    def order(self, name: str) -> torch.Tensor:
        """Items of a unit from most to least salient (pruning at any size keeps a prefix of this)."""
        return self.ranking[name].indices

    def resizable(self, units: Sequence[Unit]) -> list[Unit]:
        """The MLP widths: head counts stay as proposed (multiples of head_dim, which pruning never changes)."""
        return [u for u in units if isinstance(u, ChannelUnit)]

    @torch.no_grad()
    def apply(self, model: nn.Module, sizes: Mapping[str, int]) -> None:
        """Prune the named blocks of `model` (the fitted one or a copy) to the given sizes, keeping the top-ranked items."""
        for name, size in sizes.items():
            if name not in self.salience:
                raise KeyError(f"{name!r} was not fitted; known units: {len(self.salience)} MLP / attention blocks")
            s = self.shapes[name]
            if size % s["item"] or not s["item"] <= size <= s["full"]:
                raise ValueError(f"size for {name} must be a multiple of {s['item']} in [{s['item']}, {s['full']}], got {size}")
            if size == s["full"]:
                continue
            keep = torch.sort(self.order(name)[: size // s["item"]]).values
            block = model.get_submodule(name)
            if s["kind"] == "channels":
                block.gate_proj = _slice(block.gate_proj, rows=keep)
                block.up_proj = _slice(block.up_proj, rows=keep)
                block.down_proj = _slice(block.down_proj, cols=keep)
            else:
                query = _expand(keep, s["item"])
                kv = _expand(keep, s["head_dim"])
                block.q_proj = _slice(block.q_proj, rows=query)
                block.k_proj = _slice(block.k_proj, rows=kv)
                block.v_proj = _slice(block.v_proj, rows=kv)
                block.o_proj = _slice(block.o_proj, cols=query)


def _expand(groups: torch.Tensor, width: int) -> torch.Tensor:
    """Channel indices of whole groups of `width` consecutive channels."""
    return (groups[:, None] * width + torch.arange(width)[None, :]).reshape(-1)


def parse_layers(text: str | None) -> range | None:
    """'START:END' (END exclusive) -> range; None or '' -> every layer."""
    if not text:
        return None
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if match is None or int(match.group(1)) >= int(match.group(2)):
        raise ValueError(f"layers must be 'START:END' with START < END (END exclusive), got {text!r}")
    return range(int(match.group(1)), int(match.group(2)))
