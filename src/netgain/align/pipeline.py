"""`compress(model, calib, config)`: the whole GAC pipeline behind one verb, in the style of torchao's quantize_.

compressor.fit -> propose (per-unit sizes under the parameter ratio) -> the naive rounding baselines
and GAC's aligned re-selection under the same budget -> rebuild the model at the chosen variant's
sizes. `size` does the middle part for an already fitted compressor, so one calibration serves many
ratios. The returned `Compression` keeps every variant's sizes and the fitted compressor, so other
variants can be built from the same dense model without calibrating again (the CLI's comparison).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from . import report, store
from .compressor import Compressor
from .config import AlignConfig
from .phases import Phases, bar
from .units import Unit, aligned_fraction, full_sizes, proposed_sizes, total_params


@dataclass
class Compression:
    """What `compress` did: the fitted compressor, its units, and every variant's unit sizes."""

    config: AlignConfig
    compressor: Compressor
    units: list[Unit]
    sizes: dict[str, dict[str, int]]  # "dense", "raw", "round-nearest", "round-down", "gac" -> unit name -> size
    cost: object  # the cost model GAC used
    check: dict | None = None  # what `verify_gac` measured, if it ran
    phases: Phases = field(default_factory=Phases)  # wall time per phase: the fit's, then sizing, checking

    @property
    def budget(self) -> int:
        """Parameters of the compressible units at the raw compressor's sizes (GAC and round-down stay within)."""
        return total_params(self.units, self.sizes["raw"])

    @property
    def dense_params(self) -> int:
        return total_params(self.units, self.sizes["dense"])

    def build(self, model: nn.Module, variant: str) -> nn.Module:
        """A copy of the dense, uncompressed `model` at a variant's sizes (the embeddings are shared, not copied)."""
        if variant not in self.sizes:
            raise ValueError(f"variant must be one of {', '.join(self.sizes)}, got {variant!r}")
        candidate = copy_model(model)
        self.compressor.apply(candidate, self.sizes[variant])
        return candidate

    def compare(self, model: nn.Module, compressed: nn.Module, names, *, costs, seq_len: int, eval_chunks, repeats: int,
                progress=None) -> list[report.Row]:
        """`report.compare` over the named variants: "dense" is `model` itself (still uncompressed),
        compress's own output stands for its variant, the others are built from `model`."""
        built = {}
        for name in names:
            built[name] = model if name == "dense" else compressed if name == self.config.variant else self.build(model, name)
        return report.compare({n: (m, self.sizes[n]) for n, m in built.items()}, self.units, costs=costs,
                              preferred_multiple=self.cost.preferred_multiple, seq_len=seq_len, eval_chunks=eval_chunks,
                              repeats=repeats, progress=progress)

    def verify_gac(self, model: nn.Module, chunks) -> dict:
        """Keep GAC's sizes only where held-out text confirms them: GAC against round-down on `chunks`
        (token-id batches of the calibration's domain that the calibration did not see).

        GAC differs from round-down only by spending the budget round-down leaves on the units its
        objective values most; that objective is the compressor's prediction from the calibration
        text, and on heavily compressed models it misranked these moves on other text (ASVD on
        Gemma-3-270M at ratio 0.75: +3.1% stdlib perplexity against round-down, and +0.8% on held-out
        Python docs). When GAC's mean loss on `chunks` is not below round-down's, "gac" takes
        round-down's sizes (aligned, within budget). Returns, and keeps in `check`: the perplexity ratio
        GAC / round-down on the chunks with its 95% interval, and whether GAC's sizes were kept."""
        from . import evaluate

        if len(chunks) < 2:
            raise ValueError(f"chunks: need at least 2 held-out batches for the interval, got {len(chunks)}")
        if self.sizes["gac"] == self.sizes["round-down"]:
            self.check = {"ratio": 1.0, "low": 1.0, "high": 1.0, "kept": True, "same_as_round_down": True}
            return self.check
        losses = {}
        with self.phases.timed("GAC check"):
            for variant in ("gac", "round-down"):
                candidate = self.build(model, variant)
                losses[variant] = evaluate.chunk_losses(candidate, chunks)
                del candidate
        ratio, low, high = evaluate.paired_ratio(losses["gac"], losses["round-down"])
        self.check = {"ratio": ratio, "low": low, "high": high, "kept": ratio < 1.0, "same_as_round_down": False}
        if not self.check["kept"]:
            self.sizes["gac"] = dict(self.sizes["round-down"])
        return self.check

    def save(self, model: nn.Module, out_dir: str | Path, tokenizer=None, variant: str | None = None) -> Path:
        """`netgain.align.save` with this run's method, variant, ratio and sizes in the manifest."""
        variant = variant or self.config.variant
        return store.save(model, out_dir, tokenizer, method=self.compressor.method, variant=variant,
                          param_ratio=self.config.param_ratio, sizes=self.sizes[variant])

    def summary(self) -> dict:
        """Per variant: parameters of the units, their ratio to the budget, and the share aligned to `multiple`."""
        multiple = self.config.multiple
        return {
            v: {"unit_params": total_params(self.units, s), "vs_budget": total_params(self.units, s) / self.budget,
                f"aligned_{multiple}": aligned_fraction(self.units, s, multiple)}
            for v, s in self.sizes.items()
        }


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy that shares the input embedding (and a tied LM head) with `model`: compressors never change it."""
    embedding = model.get_input_embeddings().weight
    return copy.deepcopy(model, memo={id(embedding): embedding})


def size(compressor: Compressor, config: AlignConfig, dtype: str = "float32", progress: bool = False) -> Compression:
    """Every variant's sizes from a fitted compressor at `config`'s ratio: one calibration serves many ratios."""
    units = compressor.propose(config.param_ratio)
    cost = config.cost_model(dtype)
    sizes = {"dense": full_sizes(units), "raw": proposed_sizes(units)}
    for mode in ("nearest", "down"):
        sizes[f"round-{mode}"] = compressor.round_sizes(units, config.multiple, mode)
    # a measured cost times every candidate's kernels first, then the bar moves unit by unit
    with compressor.phases.timed("GAC sizing (kernel timing, knapsack)"), \
            bar(len(units), f"GAC candidates ({cost.name})", progress, unit="unit") as done:
        sizes["gac"] = compressor.select(units, cost, config.tokens, multiple=config.multiple, steps=config.steps,
                                         tolerance=config.tolerance, progress=done)
    if hasattr(cost, "save"):  # a measured kernel table: keep what was timed for the next run
        cost.save()
    return Compression(config, compressor, units, sizes, cost, phases=compressor.phases)


def compress(model: nn.Module, calib, config: AlignConfig | None = None, *, validation=None, inplace: bool = True,
             progress: bool = False) -> tuple[nn.Module, Compression]:
    """Compress a HF causal LM with `config`'s compressor and sizes; returns (compressed model, Compression).

    calib: token-id batches, each (batch, seq) (`evaluate.token_chunks`). validation: more batches of the
    calibration's domain, disjoint from calib; when given, GAC's sizes are kept only if they beat
    round-down's on them (`Compression.verify_gac`). The model is changed in place, like torchao's
    quantize_, unless inplace=False: then it stays dense and a copy is compressed.
    progress: tqdm bars on stderr, with the time left, for the calibration and GAC's candidate costing;
    `Compression.phases` says where the time went.
    """
    config = config or AlignConfig()
    if not isinstance(config, AlignConfig):
        raise ValueError(f"config must be an AlignConfig, got {type(config).__name__}")
    compressor = config.compressor.build()
    compressor.fit(model, calib, progress=progress)
    result = size(compressor, config, str(next(model.parameters()).dtype).removeprefix("torch."), progress)
    if validation:
        result.verify_gac(model, validation)
    target = model if inplace else copy_model(model)
    compressor.apply(target, result.sizes[config.variant])
    return target, result
