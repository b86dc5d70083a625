"""Measurements of a (compressed) causal LM: perplexity, measured and predicted prefill/decode latency.

Prefill is timed as `generate` runs it (logits for the last token only), batch 1, after warm-up,
median of repeats; decode is the time of one new token on top of a `context`-token KV cache.
Predicted latency sums a cost model's GEMMs over every Linear in the decoder layers (factorised
ones as their two GEMMs), one SDPA per layer and the LM head for one token.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from .lowrank import LowRankLinear


def read_text(path: str | Path) -> str:
    """A text file, or every *.txt under a directory (sorted), joined."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise FileNotFoundError(f"no *.txt files under {path}")
        return "\n\n".join(f.read_text(errors="replace") for f in files)
    return path.read_text(errors="replace")


def token_chunks(tokenizer, text: str, seq_len: int, count: int) -> list[torch.Tensor]:
    """`count` consecutive non-overlapping (1, seq_len) token-id chunks from the start of `text`."""
    ids = []
    for start in range(0, len(text), 200_000):  # tokenise in pieces until enough tokens
        ids += tokenizer(text[start : start + 200_000], add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len * count:
            break
    if len(ids) < seq_len * count:
        raise ValueError(f"text holds {len(ids)} tokens, fewer than {count} x {seq_len}")
    return [torch.tensor(ids[i * seq_len : (i + 1) * seq_len]).unsqueeze(0) for i in range(count)]


@torch.inference_mode()
def perplexity(model: nn.Module, chunks: list[torch.Tensor]) -> float:
    """exp(mean next-token negative log-likelihood) over the chunks."""
    total, tokens = 0.0, 0
    for ids in chunks:
        logits = model(input_ids=ids.to(model.device), use_cache=False).logits[0, :-1].float()
        total += nn.functional.cross_entropy(logits, ids[0, 1:].to(logits.device), reduction="sum").item()
        tokens += ids.shape[1] - 1
    return math.exp(total / tokens)


def _median_time(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure_prefill(model: nn.Module, seq_len: int, warmup: int = 1, repeats: int = 5) -> float:
    """Median seconds of a batch-1 prefill of `seq_len` tokens (last-token logits, as generate does)."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return _median_time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), warmup, repeats)


@torch.inference_mode()
def measure_decode(model: nn.Module, context: int, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of one decode step after a `context`-token prefill (batch 1, KV cache)."""
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    # transformers 5 calls the KV cache `cache`; earlier releases `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = getattr(model(input_ids=ids[:, :context], use_cache=True), key)
    step = {"input_ids": ids[:, context:], key: cache, "use_cache": True, "logits_to_keep": 1}
    return _median_time(lambda: model(**step), warmup, repeats)


def predicted_latency(model: nn.Module, cost, tokens: int, context: int) -> float:
    """Seconds a cost model predicts for `tokens` new tokens attending to `context` positions."""
    config = model.config
    seconds, counted = 0.0, set()
    for name, module in model.named_modules():  # parents come before their children
        if ".layers." not in f".{name}" or id(module) in counted:
            continue
        if isinstance(module, LowRankLinear):
            seconds += cost.gemm(tokens, module.in_features, module.rank) + cost.gemm(tokens, module.rank, module.out_features)
            counted.update((id(module.down), id(module.up)))
        elif isinstance(module, nn.Linear):
            seconds += cost.gemm(tokens, module.in_features, module.out_features)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    seconds += config.num_hidden_layers * cost.sdpa(1, config.num_attention_heads, tokens, context, head_dim)
    lm_head = model.get_output_embeddings()
    return seconds + cost.gemm(1, lm_head.in_features, lm_head.out_features)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
