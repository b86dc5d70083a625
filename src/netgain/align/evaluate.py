"""Measurements of a (compressed) causal LM: perplexity, measured and predicted prefill/decode latency.

Latency of several variants is timed in turns (see `interleaved_latency`), batch 1, median of repeats.
Predicted latency sums a cost model's GEMMs over every Linear in the decoder layers (factorised
ones as their two GEMMs), one SDPA per attention block at its actual (possibly pruned) head count
and the LM head for one token.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from .lowrank import LowRankLinear
from .prune import head_layout, is_attention


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


@torch.inference_mode()
def interleaved_latency(models: Mapping[str, nn.Module], seq_len: int, repeats: int = 5, warmup: int = 1) -> dict[str, dict[str, float]]:
    """Median prefill and decode seconds of each model (batch 1), timed in turns A B C A B C ...

    Prefill runs `seq_len` tokens with last-token logits only, as `generate` does; decode is one new
    token on top of a `seq_len`-token KV cache. Taking turns spreads the load of other processes on
    a shared machine over every model alike, so the ratios between models stay meaningful.
    """
    ids = torch.randint(0, min(m.config.vocab_size for m in models.values()), (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    prompts, decode_inputs = {}, {}
    for name, model in models.items():
        prompts[name], step = ids[:, :seq_len].to(model.device), ids[:, seq_len:].to(model.device)
        # transformers 5 calls the KV cache `cache`; earlier releases `past_key_values`
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = getattr(model(input_ids=prompts[name], use_cache=True), key)
        decode_inputs[name] = {"input_ids": step, key: cache, "use_cache": True, "logits_to_keep": 1}
    times = {name: {"prefill_s": [], "decode_s": []} for name in models}
    for round_ in range(warmup + repeats):
        for name, model in models.items():
            sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            model(input_ids=prompts[name], use_cache=False, logits_to_keep=1)
            sync()
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model(**decode_inputs[name])
            sync()
            decode = time.perf_counter() - start
            if round_ >= warmup:
                times[name]["prefill_s"].append(prefill)
                times[name]["decode_s"].append(decode)
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def predicted_latency(model: nn.Module, cost, tokens: int, context: int) -> float:
    """Seconds a cost model predicts for `tokens` new tokens attending to `context` positions."""
    seconds, counted = 0.0, set()
    for name, module in model.named_modules():  # parents come before their children
        if ".layers." not in f".{name}" or id(module) in counted:
            continue
        if isinstance(module, LowRankLinear):
            seconds += cost.gemm(tokens, module.in_features, module.rank) + cost.gemm(tokens, module.rank, module.out_features)
            counted.update((id(module.down), id(module.up)))
        elif isinstance(module, nn.Linear):
            seconds += cost.gemm(tokens, module.in_features, module.out_features)
        elif is_attention(module):  # heads from q_proj's width, so pruned heads are not counted
            head_dim, heads, _ = head_layout(module)
            seconds += cost.sdpa(1, heads, tokens, context, head_dim)
    lm_head = model.get_output_embeddings()
    return seconds + cost.gemm(1, lm_head.in_features, lm_head.out_features)

