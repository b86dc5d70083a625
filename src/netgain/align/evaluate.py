"""Measurements of a (compressed) causal LM: perplexity, measured and predicted prefill/decode latency.

Latency of several variants is timed in turns (see `interleaved_latency`), batch 1, median of repeats
after outlier rejection, with its spread. Predicted latency is `netgain.cost.latency.predict`: every
GEMM (factorised Linears as their two), one SDPA per attention block at its actual (possibly pruned)
head count, the per-layer norms, activation, attention glue and module calls, and the LM head.
"""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..cost.latency import predict
from ..files import in_bytes, machine_memory_bytes, require_regular_file
from ..cost.timing import interleaved


def read_text(path: str | Path, flag: str = "text") -> str:
    """A text file, or every *.txt under a directory (sorted), joined. Only regular files are read, at most
    a quarter of this machine's memory in all (a FIFO blocked for ever, /dev/zero never ended); else a
    ValueError naming `flag`."""
    path = Path(path)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.txt files under {path}")
    limit = machine_memory_bytes() // 4
    if sum(require_regular_file(file, flag, limit) for file in files) > limit:
        raise ValueError(f"{flag} {path} holds more than the {in_bytes(limit)} of text netgain reads")
    return "\n\n".join(f.read_text(errors="replace") for f in files)


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


def perplexity(model: nn.Module, chunks: list[torch.Tensor]) -> float:
    """exp(mean next-token negative log-likelihood) over the chunks."""
    return perplexity_of(chunk_losses(model, chunks), chunks)


def perplexity_of(losses: list[float], chunks: list[torch.Tensor]) -> float:
    """exp(mean next-token loss) from each chunk's mean loss (`chunk_losses`), weighted by its predictions."""
    predictions = [ids.shape[1] - 1 for ids in chunks]
    return math.exp(sum(l * n for l, n in zip(losses, predictions)) / sum(predictions))


@torch.inference_mode()
def chunk_losses(model: nn.Module, chunks: list[torch.Tensor]) -> list[float]:
    """Mean next-token negative log-likelihood of each chunk: two models compared chunk by chunk on
    the same text give a paired difference whose spread says how far the text alone moves it."""
    out = []
    for ids in chunks:
        logits = model(input_ids=ids.to(model.device), use_cache=False).logits[0, :-1].float()
        out.append(nn.functional.cross_entropy(logits, ids[0, 1:].to(logits.device)).item())
    return out


# Student's t at 97.5% for 1..30 degrees of freedom (a two-sided 95% interval); the normal's 1.96 beyond
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio(losses: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """Perplexity ratio of two models on the same equal-length chunks, with the 95% interval from the
    chunk-to-chunk spread of their loss difference (Student's t over the chunks): (ratio, low, high).
    One chunk has no spread: (ratio, 0, inf)."""
    if len(losses) != len(baseline) or not losses:
        raise ValueError(f"losses and baseline: need the same chunks, got {len(losses)} and {len(baseline)}")
    diffs = [a - b for a, b in zip(losses, baseline)]
    n, mean = len(diffs), sum(diffs) / len(diffs)
    if n == 1:
        return math.exp(mean), 0.0, math.inf
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@torch.inference_mode()
def interleaved_latency(models: Mapping[str, nn.Module], seq_len: int, repeats: int = 5, warmup: int = 1) -> dict[str, dict[str, float]]:
    """Prefill and decode seconds of each model (batch 1): median after outlier rejection, and spread.

    Prefill runs `seq_len` tokens with last-token logits only, as `generate` does; decode is one new
    token on top of a `seq_len`-token KV cache (a fresh copy before every step, untimed, so the context
    stays `seq_len`; sliding-window caches cannot be cropped back). Every call is timed once per round in a rotating order (`netgain.cost.timing`): the
    load of other processes on a shared machine spreads over every model alike, so the ratios
    between models stay meaningful; `*_spread` is the interquartile range / median of the kept samples.
    """
    ids = torch.randint(0, min(m.config.vocab_size for m in models.values()), (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    calls, before = {}, {}
    for name, model in models.items():
        prompt, step = ids[:, :seq_len].to(model.device), ids[:, seq_len:].to(model.device)
        # transformers 5 calls the KV cache `cache`; earlier releases `past_key_values`
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = getattr(model(input_ids=prompt, use_cache=True), key)
        decode = {"input_ids": step, "use_cache": True, "logits_to_keep": 1}
        calls[f"{name}\tprefill"] = lambda model=model, prompt=prompt: model(input_ids=prompt, use_cache=False, logits_to_keep=1)
        calls[f"{name}\tdecode"] = lambda model=model, decode=decode: model(**decode)
        before[f"{name}\tdecode"] = lambda decode=decode, cache=cache, key=key: decode.update({key: copy.deepcopy(cache)})
    sync = torch.cuda.synchronize if any(m.device.type == "cuda" for m in models.values()) else None
    timed = interleaved(calls, repeats, warmup, sync, before)
    result = {}
    for name in models:
        prefill, decode = timed[f"{name}\tprefill"], timed[f"{name}\tdecode"]
        result[name] = {"prefill_s": prefill.median_s, "decode_s": decode.median_s,
                        "prefill_spread": prefill.spread, "decode_spread": decode.spread}
    return result


def predicted_latency(model: nn.Module, cost, tokens: int, context: int, logits: int = 1) -> float:
    """Seconds a cost model predicts for `tokens` new tokens attending to `context` positions, with
    logits for the last `logits` tokens: kernels plus per-layer overheads (`netgain.cost.latency`)."""
    return predict(model, cost, tokens, context, logits).total_s
