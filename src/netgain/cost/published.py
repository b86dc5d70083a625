"""The GAC paper's published A100 latencies and the Llama-3-8B shapes behind them: the analytic model's calibration set.

../shared/papers/gac.md, Table "The authors' results": Llama-3-8B, 15% of the decoder-Linear parameters
removed, FP16, batch 1, prefill on an A100 (the authors' scripts call `model(input_ids)`, so the LM
head runs for every token). The paper says S=1024 for every row, but its scripts (sands-lab/GAC)
time the rows at different lengths (`PAPER_SEQ_LEN`): the dense and LLM-Pruner rows come from
scripts/llmpruner_gac_experiment.py at S=1024 (CUDA events; its 1024 bars are the table's numbers
in Latex/figures/fig_prefill_scaling), while every ASVD latency script (asvd_gac_experiment.py's
benchmark_latency, asvd_simple.py, asvd_alignment_experiment.py) defaults to seq_len=512 and the
slurm jobs never override it (run_asvd_simple.sbatch passes --seq_len 512). The same figure's
S=512 bars (`FIGURE_A100_MS_S512`, read off the chart to about 1 ms) give the pruner script's
rows at the ASVD rows' length, as a check outside the fit.
The authors' per-layer sizes are not published, so each row's shapes are rebuilt from what the
paper and its scripts specify:

- ASVD factorises all 224 decoder Linears at ranks floor(floor(m n p) / (m + n)) for a per-layer
  grid ratio p; here every projection type cycles through p = 0.7, 0.8, 0.9, 1.0 over the layers
  (p = 1 is the break-even rank, which the authors' code also factorises): mean ratio 0.85, and
  7% of the ranks are multiples of 8 (the paper: 5%).
- ASVD + GAC: the same ranks at the nearest multiple of 8 (within 0.1% of the raw budget).
- LLM-Pruner prunes MLP channels only, in layers 3-31, by a global ranking (unequal widths):
  widths spread +-20% (seeded) around the mean that removes 15% of the parameters.
- LLM-Pruner + GAC is LLM-Pruner's own round_to=8: the same widths at the nearest multiple of 8.
Models are built on the meta device (shapes only); a factorised Linear is two nn.Linears in an
nn.Sequential, which `netgain.cost.latency` times as the two GEMMs it is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAPER_A100_MS = {"dense": 99.6, "asvd": 100.5, "asvd+gac": 67.1, "llm-pruner": 137.7, "llm-pruner+gac": 88.0}
PAPER_SEQ_LEN = {"dense": 1024, "asvd": 512, "asvd+gac": 512, "llm-pruner": 1024, "llm-pruner+gac": 1024}
FIGURE_A100_MS_S512 = {"dense": 53.5, "llm-pruner": 72.2, "llm-pruner+gac": 48.2}  # bars, and their +35% / -10% labels
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256,
)
ASVD_RATIOS = (0.7, 0.8, 0.9, 1.0)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRUNED_LAYERS = range(3, 32)
COMPRESSION = 0.15
WIDTH_SPREAD = 0.2


def llama3_8b() -> nn.Module:
    """Llama-3-8B's architecture on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA3_8B)).eval()


def asvd_ranks(model: nn.Module) -> dict[str, int]:
    """ASVD-style ranks per decoder Linear (see the module docstring)."""
    ranks = {}
    for name, linear in _decoder_linears(model).items():
        layer, projection = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        ratio = ASVD_RATIOS[(layer + PROJECTIONS.index(projection)) % len(ASVD_RATIOS)]
        m, n = linear.in_features, linear.out_features
        ranks[name] = math.floor(m * n * ratio) // (m + n)
    return ranks


def pruned_widths() -> dict[int, int]:
    """LLM-Pruner-style MLP widths per pruned layer (see the module docstring)."""
    hidden, width, layers = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["num_hidden_layers"]
    per_layer = hidden * (2 * hidden + 2 * hidden * LLAMA3_8B["num_key_value_heads"] // LLAMA3_8B["num_attention_heads"]) + 3 * hidden * width
    removed_channels = COMPRESSION * layers * per_layer / (3 * hidden) / len(PRUNED_LAYERS)
    jitter = torch.empty(len(PRUNED_LAYERS)).uniform_(-WIDTH_SPREAD, WIDTH_SPREAD, generator=torch.Generator().manual_seed(0))
    jitter -= jitter.mean()  # the spread moves channels between layers, not the total
    mean = width - removed_channels
    return {layer: int(round(mean * (1 + float(j)))) for layer, j in zip(PRUNED_LAYERS, jitter)}


def aligned(value: int, multiple: int = 8) -> int:
    return multiple * round(value / multiple)


def variant(name: str) -> nn.Module:
    """One of the paper's rows as a meta-device model."""
    if name not in PAPER_A100_MS:
        raise ValueError(f"name must be one of {list(PAPER_A100_MS)}, got {name!r}")
    model = llama3_8b()
    if name.startswith("asvd"):
        for layer_name, rank in asvd_ranks(model).items():
            linear = model.get_submodule(layer_name)
            rank = aligned(rank) if name.endswith("+gac") else rank
            with torch.device("meta"):
                factors = nn.Sequential(nn.Linear(linear.in_features, rank, bias=False), nn.Linear(rank, linear.out_features, bias=False))
            model.set_submodule(layer_name, factors)
    elif name.startswith("llm-pruner"):
        for layer, width in pruned_widths().items():
            width = aligned(width) if name.endswith("+gac") else width
            mlp = model.model.layers[layer].mlp
            hidden = mlp.gate_proj.in_features
            with torch.device("meta"):
                mlp.gate_proj, mlp.up_proj = nn.Linear(hidden, width, bias=False), nn.Linear(hidden, width, bias=False)
                mlp.down_proj = nn.Linear(width, hidden, bias=False)
    return model


def aligned_fraction(model: nn.Module, multiple: int = 8) -> float:
    """Share of the decoder GEMMs' K and N dimensions that are multiples of `multiple` (the paper's count)."""
    dims = [d for m in model.model.layers.modules() if isinstance(m, nn.Linear) for d in (m.in_features, m.out_features)]
    return sum(d % multiple == 0 for d in dims) / len(dims)


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{n}"}
