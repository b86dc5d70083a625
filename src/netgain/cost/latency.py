"""Whole-model latency of a (compressed) HF causal LM: kernels plus the per-layer work around them.

A forward is more than its GEMMs and attention: every decoder layer also runs norms, the MLP
activation, the rotary embedding, residual adds, a KV-cache append when decoding, and pays the
framework's cost per module call. Leaving those out made predictions miss whole-model timings by
tens of percent (issue 13). `predict` walks the model and asks a cost model (`MeasuredCost`:
timed on this device; `AnalyticCost`: a GPU model) for each part, so the prediction can be checked
against a measured forward and every term shows in the breakdown. It reads shapes only: a
factorised Linear is found as its two nn.Linear children, a pruned block by its smaller widths.
A cost model needs `gemm` and `sdpa`; one without the overhead methods (`norm`, `activation`,
`elementwise`, `framework`) predicts the kernels alone. Where the host's time is the latency
(`cost.host_bound`: eager PyTorch on a CPU), the framework term also charges every aten op the
forward dispatches outside the separately timed parts; they are counted once per architecture by
running the model's config on the meta device.
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# streaming passes (read one tensor, write one) of the elementwise work HF's eager decoder layer does
ROPE_PASSES = 4  # q * cos + rotate_half(q) * sin: halves sliced, negated and joined, two products, a sum
RESIDUAL_PASSES = 1.5  # a + b reads two tensors and writes one
EMBEDDING_PASSES = 2  # the token gather and its scale (Gemma) or copy
LAYER = re.compile(r"(?:^|\.)layers\.\d+$")
OVERHEADS = ("norm", "activation", "elementwise", "framework")


@dataclass
class Breakdown:
    """Seconds per part of one forward."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    norm_s: float = 0.0
    activation_s: float = 0.0
    glue_s: float = 0.0  # rotary embedding, residual adds, KV-cache appends, embedding, output transposes
    framework_s: float = 0.0  # module calls and the aten ops (views, casts, masks) outside the timed parts

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.norm_s + self.activation_s + self.glue_s + self.framework_s

    @property
    def overhead_s(self) -> float:
        """Everything but the GEMMs and attention."""
        return self.norm_s + self.activation_s + self.glue_s + self.framework_s

    def as_dict(self) -> dict:
        return {**asdict(self), "overhead_s": self.overhead_s, "total_s": self.total_s}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (entries of a `layers` ModuleList), in order."""
    return [m for name, m in model.named_modules() if LAYER.search(name)]


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def norm_width(module: nn.Module) -> int:
    """The normalised width: the weight's length, or nn.LayerNorm's normalized_shape without one."""
    weight = getattr(module, "weight", None)
    return weight.shape[-1] if weight is not None else module.normalized_shape[-1]


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or of a stand-in for one (its first and last nn.Linear: a factorised pair)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(module).__name__} holds no nn.Linear")
    return linears[0].in_features, linears[-1].out_features


def predict(model: nn.Module, cost, tokens: int, context: int, logits: int = 1) -> Breakdown:
    """Seconds a cost model predicts for one forward of `tokens` new tokens attending to `context`
    positions (a KV cache when context > tokens), batch 1, with logits for the last `logits` tokens."""
    for name, value in (("tokens", tokens), ("context", context), ("logits", logits)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if context < tokens or logits > tokens:
        raise ValueError(f"need tokens <= context and logits <= tokens, got tokens={tokens}, context={context}, logits={logits}")
    if not all(hasattr(cost, m) for m in OVERHEADS):
        cost = _KernelsOnly(cost)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("model has no decoder layers (a ModuleList named 'layers')")
    parts = Breakdown()
    inside = set()
    calls = 0
    for layer in layers:
        calls += _layer(layer, cost, tokens, context, parts)
        inside.update(id(m) for m in layer.modules())
    lm_head = model.get_output_embeddings()
    hidden = lm_head.in_features
    parts.gemm_s += cost.gemm(logits, hidden, lm_head.out_features)
    outside = [m for m in model.modules() if id(m) not in inside and m is not lm_head]
    for module in outside:
        if is_norm(module):  # the final norm runs on every token; the LM head only on `logits` of them
            parts.norm_s += cost.norm(module, (1, tokens, norm_width(module)))
    parts.glue_s += cost.elementwise(tokens * hidden, EMBEDDING_PASSES)
    ops = untimed_ops(model.config, tokens, context) if getattr(cost, "host_bound", False) else 0
    parts.framework_s += cost.framework(calls + len(outside) + 1, ops)
    return parts


def untimed_ops(config, tokens: int, context: int) -> int:
    """aten ops one forward dispatches outside its Linears, norms, activations and SDPA, counted on a
    meta-device twin built from `config` (once per config and shape)."""
    key = (config.to_json_string(use_diff=False), tokens, context)
    if key not in _OPS:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            twin = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
        counter = _OpCounter()
        activations = {id(m.act_fn) for m in twin.modules() if hasattr(m, "act_fn")}
        for module in twin.modules():  # what is timed on its own does not count again
            if isinstance(module, nn.Linear) or is_norm(module) or id(module) in activations:
                module.register_forward_pre_hook(lambda *_: counter.pause(True))
                module.register_forward_hook(lambda *_: counter.pause(False))
        ids = torch.zeros(1, context, dtype=torch.long, device="meta")
        # transformers 5 calls the KV cache `cache`; earlier releases `past_key_values`
        name = "cache" if "cache" in inspect.signature(twin.forward).parameters else "past_key_values"
        with torch.inference_mode():  # with a cache even for prefill: HF's cache-less path reads values (.item())
            cache = getattr(twin(input_ids=ids[:, : context - tokens], use_cache=True), name) if context > tokens else None
            with counter:
                twin(input_ids=ids[:, context - tokens :], **{name: cache}, use_cache=True, logits_to_keep=1)
        _OPS[key] = counter.count
    return _OPS[key]


_OPS: dict[tuple[str, int, int], int] = {}


class _OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops, except while paused and except attention itself (timed as SDPA)."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def pause(self, paused: bool) -> None:
        self.paused = paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and "scaled_dot_product" not in func.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _layer(layer: nn.Module, cost, tokens: int, context: int, parts: Breakdown) -> int:
    """Add one decoder layer's parts; returns its module calls."""
    calls = 0
    hidden = None
    for name, module in layer.named_modules():
        calls += 1
        if isinstance(module, nn.Linear):
            parts.gemm_s += cost.gemm(tokens, module.in_features, module.out_features)
        elif hasattr(module, "q_proj") and hasattr(module, "head_dim"):
            hidden = features(module.q_proj)[0]
            _attention(module, cost, tokens, context, parts)
        elif hasattr(module, "act_fn") and hasattr(module, "gate_proj"):
            parts.activation_s += cost.activation(module.act_fn, (1, tokens, features(module.gate_proj)[1]))
    for name, module in layer.named_modules():
        if is_norm(module):
            parts.norm_s += cost.norm(module, _norm_shape(layer, name, module, tokens))
    if hidden is not None:  # two residual adds around attention and MLP
        parts.glue_s += cost.elementwise(tokens * hidden, 2 * RESIDUAL_PASSES)
    return calls


def _attention(block: nn.Module, cost, tokens: int, context: int, parts: Breakdown) -> None:
    """SDPA at the block's actual (possibly pruned) head count, rotary embedding, output transpose, cache append."""
    head_dim = block.head_dim
    heads, kv_heads = features(block.q_proj)[1] // head_dim, features(block.k_proj)[1] // head_dim
    parts.attention_s += cost.sdpa(1, heads, tokens, context, head_dim)
    parts.glue_s += cost.elementwise(tokens * (heads + kv_heads) * head_dim, ROPE_PASSES)
    parts.glue_s += cost.elementwise(tokens * heads * head_dim, 1)  # (B, H, S, D) -> (B, S, H*D) before o_proj
    if context > tokens:  # the cache concatenates the new keys and values onto the old: a copy of both
        parts.glue_s += cost.elementwise(2 * context * kv_heads * head_dim, 1)


def _norm_shape(layer: nn.Module, name: str, module: nn.Module, tokens: int) -> tuple[int, ...]:
    """A norm's input: (1, tokens, width), or per head (1, tokens, heads, head_dim) for q/k norms."""
    width = norm_width(module)
    parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
    if getattr(parent, "head_dim", None) == width and hasattr(parent, "q_proj"):
        projection = parent.k_proj if name.endswith("k_norm") else parent.q_proj
        return (1, tokens, features(projection)[1] // width, width)
    return (1, tokens, width)


class _KernelsOnly:
    """A kernels-only cost model seen through the full interface: the overheads cost nothing."""

    def __init__(self, cost):
        self.gemm, self.sdpa = cost.gemm, cost.sdpa

    def norm(self, module, shape) -> float:
        return 0.0

    activation = norm

    def elementwise(self, numel, passes=1) -> float:
        return 0.0

    def framework(self, calls, ops) -> float:
        return 0.0
