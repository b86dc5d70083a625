"""One row per model variant (dense, raw compressor, naive rounding, GAC), and two tables that compare
them, one per question: quality (parameters, perplexity) and latency (alignment, measured, predicted)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from torch import nn

from ..models import parameter_count
from . import evaluate
from .units import Unit, aligned_fraction, total_params


@dataclass
class Row:
    variant: str
    unit_params: int  # parameters in the compressible units at this variant's sizes
    model_params: int
    aligned_8: float
    aligned_preferred: float
    perplexity: float
    measured_prefill_s: float
    measured_decode_s: float
    measured_prefill_spread: float  # interquartile range / median of the timed rounds
    measured_decode_spread: float
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)  # cost name -> {"prefill_s", "decode_s"}

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    variants: Mapping[str, tuple[nn.Module, Mapping[str, int]]],
    units: Sequence[Unit],
    *,
    costs: Mapping[str, object],
    preferred_multiple: int,
    seq_len: int,
    eval_chunks,
    repeats: int,
    progress=None,
) -> list[Row]:
    """One row per variant (model, unit sizes): parameters, alignment, perplexity, predicted latency,
    and measured latency timed in turns across all variants."""
    rows = []
    for variant, (model, sizes) in variants.items():
        rows.append(
            Row(
                variant=variant,
                unit_params=total_params(units, sizes),
                model_params=parameter_count(model),
                aligned_8=aligned_fraction(units, sizes, 8),
                aligned_preferred=aligned_fraction(units, sizes, preferred_multiple),
                perplexity=evaluate.perplexity(model, eval_chunks),
                measured_prefill_s=float("nan"),
                measured_decode_s=float("nan"),
                measured_prefill_spread=float("nan"),
                measured_decode_spread=float("nan"),
                predicted={
                    name: {
                        "prefill_s": evaluate.predicted_latency(model, cost, seq_len, seq_len),
                        "decode_s": evaluate.predicted_latency(model, cost, 1, seq_len + 1),
                    }
                    for name, cost in costs.items()
                },
            )
        )
        if progress is not None:
            progress.update(1)
    latency = evaluate.interleaved_latency({v: m for v, (m, _) in variants.items()}, seq_len, repeats)
    for row in rows:
        row.measured_prefill_s = latency[row.variant]["prefill_s"]
        row.measured_decode_s = latency[row.variant]["decode_s"]
        row.measured_prefill_spread = latency[row.variant]["prefill_spread"]
        row.measured_decode_spread = latency[row.variant]["decode_spread"]
    if progress is not None:
        progress.update(1)
    return rows


def markdown(rows: Sequence[Row], budget: int, preferred_multiple: int, baseline: str = "dense") -> str:
    """Two tables, one per question: how good is each variant (quality), and how fast (latency).
    Ratios are to the `baseline` row (else the first) measured in the same run."""
    base = next((r for r in rows if r.variant == baseline), rows[0])
    quality = table(
        ["variant", "unit params", "/ budget", "model params", "perplexity", f"vs {base.variant}"],
        [[r.variant, f"{r.unit_params:,}", f"{r.unit_params / budget:.4f}", f"{r.model_params:,}", f"{r.perplexity:.3f}",
          f"{r.perplexity / base.perplexity:.3f}"] for r in rows],
    )
    costs = list(rows[0].predicted)
    latency = table(
        ["variant", f"aligned %8 / %{preferred_multiple}", f"measured prefill ms ± spread (vs {base.variant})",
         f"measured decode ms ± spread (vs {base.variant})"] + [f"predicted prefill / decode ms ({c})" for c in costs],
        [[r.variant, f"{100 * r.aligned_8:.0f}% / {100 * r.aligned_preferred:.0f}%",
          f"{r.measured_prefill_s * 1e3:.1f} ±{100 * r.measured_prefill_spread:.0f}% "
          f"({r.measured_prefill_s / base.measured_prefill_s:.3f})",
          f"{r.measured_decode_s * 1e3:.2f} ±{100 * r.measured_decode_spread:.0f}% "
          f"({r.measured_decode_s / base.measured_decode_s:.3f})"]
         + [f"{r.predicted[c]['prefill_s'] * 1e3:.3f} / {r.predicted[c]['decode_s'] * 1e3:.3f}" for c in costs]
         for r in rows],
    )
    return f"Quality (perplexity on the held-out text):\n\n{quality}\nLatency (batch 1):\n\n{latency}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
