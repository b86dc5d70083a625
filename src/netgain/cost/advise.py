"""`netgain model`: predict, before a job starts, which gradient codec pays off on a network.

Users' first complaint about gradient compression is that it does not speed anything up on their
cluster. This runs the alpha-beta model of netgain.cost.network for every codec on the given
model size, world size and fabric, and prints step time, communication and speedup. It recommends
what auto would run, from auto's own planner, so that a user who follows it runs what was priced;
beside it, the fixed codec for a run that pins one: the least lossy (most bytes on the wire) within a
tolerance of the fastest, "none" when nothing pays off. Given measured steps to a target loss
(`--steps-from`, as bench/time_to_accuracy.py writes them), "fastest" means time to target: step time
x steps. On two levels (nodes of several GPUs) it recommends a route, DDP or HSDP, and its codec.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from netgain.cost import network as net
from netgain.cost.kernels import GPUS
from netgain.cost.modelconfig import load_config, meta_model
from netgain.files import require_regular_file

GPU_CHOICES = (*GPUS, "cpu")
DEFAULT_LINK = "25gbe"
DDP_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb, with a first bucket of DDP_FIRST_BUCKET_MB
DDP_FIRST_BUCKET_MB = 1.0
MAX_BUCKETS = 1_000_000  # each bucket is stepped through: 915k (--params 6e12) take 33 s
# what a data-parallel job can physically be: beyond these the model's sums run to inf and nan
BANDWIDTH_RANGE = (1e3 / 8, 1e16 / 8)  # bytes/s per rank: 1 kbit/s to 10 Pbit/s
MAX_LATENCY_S = 10.0  # per message (a geostationary satellite hop is 0.6 s)
MAX_COMPUTE_MS = 1e9  # forward + backward of one step: 11.6 days
SAFETENSORS_HEADER_MAX = 100 << 20  # the safetensors format's own limit on its JSON header


@dataclass(frozen=True)
class Row:
    profile: net.CodecProfile
    prediction: net.Prediction
    speedup: float
    convergence: str  # "unbiased", "low-rank" (error feedback), "rounded" (16-bit casts) or "biased": see CONVERGES
    steps: float | None = None  # steps to the target loss / fp32's (inf: never reached); None: not measured
    route: str = "DDP"  # or "HSDP" (net.predict_hsdp)

    @property
    def time_s(self) -> float:
        """Predicted seconds to the target per fp32 step: step time x steps (step time where not measured)."""
        return self.prediction.step_s * (1.0 if self.steps is None else self.steps)


@dataclass(frozen=True)
class LocalSteps:
    """auto's route of local steps as `netgain model` prices it (netgain.sync gives it, as data: netgain.cost knows no
    codecs): the average's codec, every `period` steps, applied `overlap_steps` later, and its steps to the target as
    a multiple of fp32's, measured where `measured` says."""
    profile: net.CodecProfile
    period: int
    overlap_steps: int
    steps: float
    measured: str


CONVERGES = ("unbiased", "low-rank", "rounded")  # recommended without --allow-biased
STEPS_COLUMNS = ("workers", "codec", "steps_ratio")
STEPS_MAX_BYTES = 16 << 20  # a --steps-from CSV: bench's are a few kB


def read_steps(paths: list[str], world_size: int) -> dict[str, float]:
    """Steps to a target loss per codec, as a multiple of fp32's, from CSV files with the columns
    workers, codec, steps_ratio (bench/time_to_accuracy.py's *.csv has them; rows without a codec,
    such as PyTorch's hooks, are skipped). Convergence depends on the world size (the global batch),
    not on the link: the rows at `world_size` are used where a codec has any, else its others; the
    median over cells. An empty steps_ratio (the target not reached in every round) counts as never."""
    found: dict[str, dict[bool, list[float]]] = {}
    for path in paths:
        require_regular_file(path, "--steps-from", STEPS_MAX_BYTES)  # a FIFO blocked forever
        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                missing = [c for c in STEPS_COLUMNS if c not in (reader.fieldnames or ())]
                if missing:
                    raise ValueError(f"--steps-from {path}: needs the columns {', '.join(STEPS_COLUMNS)}; "
                                     f"missing {', '.join(missing)}")
                for line, row in enumerate(reader, start=2):
                    if not row["codec"]:
                        continue
                    ratio = math.inf if row["steps_ratio"] == "" else _number(row["steps_ratio"], float)
                    workers = _number(row["workers"], int)
                    if workers is None or workers < 1 or ratio is None or not ratio > 0:
                        raise ValueError(f"--steps-from {path}, line {line}: workers must be an integer >= 1 and "
                                         f"steps_ratio a number > 0 or empty (never reached), got "
                                         f"{row['workers']!r} and {row['steps_ratio']!r}")
                    found.setdefault(row["codec"], {True: [], False: []})[workers == world_size].append(ratio)
        except OSError as error:
            raise ValueError(f"--steps-from {path}: {error.strerror}") from error
        except UnicodeDecodeError as error:
            raise ValueError(f"--steps-from {path}: not a text CSV ({error.reason})") from error
    return {codec: statistics.median(by[True] or by[False]) for codec, by in found.items()}


def _number(text: str | None, kind):
    """`text` as `kind` (int or float), None where it is not one (a short row's cell is None)."""
    try:
        return kind(text)
    except (TypeError, ValueError):
        return None


def count_parameters(model_dir: str, register_types=None) -> list[tuple[int, ...]]:
    """Parameter shapes of a Hugging Face model folder, in registration order (DDP's bucket order).

    Builds the architecture from config.json on the meta device (no weights read); folders whose
    architecture transformers cannot build are counted from their safetensors headers instead.
    ``register_types``: called first, to register model types transformers does not know (the CLI passes
    netgain.align's, so a compressed folder builds with its real layers; netgain.cost knows no align).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model: {model_dir!r} is not a folder")
    try:
        return _meta_parameter_sizes(path, register_types)
    except ValueError as error:
        sizes = _safetensors_sizes(path)
        if not sizes:
            raise ValueError(f"--model: {model_dir!r} has no buildable config.json "
                             f"({error}) and no *.safetensors files") from error
        return sizes


def _meta_parameter_sizes(path: Path, register_types=None) -> list[tuple[int, ...]]:
    if register_types is not None:
        register_types()
    model = meta_model(load_config(path, "--model"), "--model")
    return [tuple(p.shape) for p in model.parameters()]


def _safetensors_sizes(path: Path) -> list[tuple[int, ...]]:
    """Shapes from the JSON headers of *.safetensors files (8-byte length, then JSON), read only from regular
    files and only as far as the length the file can hold."""
    sizes = []
    for file in sorted(path.glob("*.safetensors")):
        size = require_regular_file(file, "--model", None)
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > min(size - 8, SAFETENSORS_HEADER_MAX):
                raise ValueError(f"--model: {file} is no safetensors file (its header would be {length} bytes)")
            try:
                header = json.loads(f.read(length))
                sizes += [_shape(entry["shape"]) for name, entry in header.items() if name != "__metadata__"]
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"--model: {file} has no safetensors header of tensor shapes ({error!r})") from None
    return sizes


def _shape(shape) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"a shape must be a list of sizes >= 0, got {shape!r}")
    return tuple(shape)


def resolve_link(args, level: str = "", default: str = DEFAULT_LINK) -> tuple[net.Link, str]:
    """The fabric from --link or --bandwidth/--latency, and the device usually attached to it; with `level`
    "intra" or "inter", a two-level cluster's from --intra-link ... or --inter-link ..., `default` without any."""
    flag, attr = (f"--{level}-", f"{level}_") if level else ("--", "")
    preset, bandwidth, latency_text = (getattr(args, attr + key) for key in ("link", "bandwidth", "latency"))
    if bandwidth is not None and preset:
        raise ValueError(f"{flag}link {preset} and {flag}bandwidth {bandwidth} both name the link: give one "
                         f"({flag}bandwidth, with {flag}latency, describes a link that is not a preset)")
    latency = None
    if latency_text is not None:
        latency = net.parse_duration(latency_text, f"{flag}latency")
        _require_within(latency, (0.0, MAX_LATENCY_S), f"{flag}latency", latency_text, "0 s and 10 s")
    if bandwidth is not None:
        rate = net.parse_bandwidth(bandwidth, f"{flag}bandwidth")
        _require_within(rate, BANDWIDTH_RANGE, f"{flag}bandwidth", bandwidth, "1 kbit/s and 10 Pbit/s")
        latency = 30e-6 if latency is None else latency
        return net.Link("custom", rate, latency, f"{flag}bandwidth {bandwidth}, latency {latency * 1e6:g} us"), "a100"
    name = preset or default
    link = net.preset(name)
    if latency is not None:
        link = dataclasses.replace(link, latency=latency)
    return link, net.preset_device(name)


def _require_within(value: float, bounds: tuple[float, float], flag: str, text: str, allowed: str) -> None:
    if not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{flag} must be between {allowed}, got {text}")


def evaluate(buckets: list[int], world_size: int, link: net.Link, compute_s: float,
             profiles: list[tuple[net.CodecProfile, str]], algorithm: str = "auto",
             tensors: list[int] | None = None, shapes: list[list[tuple[int, ...]]] | None = None,
             codec_shares_compute: bool = False, steps: dict[str, float] | None = None,
             hsdp: net.Cluster | None = None, baseline_s: float | None = None) -> list[Row]:
    """Predict every candidate codec, given as (profile, convergence) data: netgain.cost knows no
    codecs (the CLI passes netgain.comm.config.candidate_profiles). `tensors`: parameters per
    bucket; `shapes`: their shapes per bucket (net.ddp_bucket_shapes), which size low-rank factors;
    `codec_shares_compute`: see net.predict (True on CPU workers); `steps`: measured steps to the
    target per codec name (read_steps; "none" is 1 by definition). `hsdp`: price HSDP on this cluster
    (net.predict_hsdp, the codec across nodes; world_size and link unused) instead of DDP; `baseline_s`:
    the step the speed-ups are against (default: this route's "none")."""
    options = dict(algorithm=algorithm, tensors=tensors, shapes=shapes, codec_shares_compute=codec_shares_compute)
    predictions = [(profile, convergence, net.predict_hsdp(buckets, hsdp, profile, compute_s, **options) if hsdp
                    else net.predict(buckets, world_size, link, profile, compute_s, **options))
                   for profile, convergence in profiles]
    baseline = baseline_s if baseline_s is not None else next(p for prof, _, p in predictions if prof.name == "none").step_s
    # HSDP's candidates are fewer: a CSV of low rank only is still DDP's to weigh
    if steps is not None and not hsdp and not any(prof.name in steps for prof, _, _ in predictions if prof.name != "none"):
        raise ValueError(f"--steps-from: none of its codecs ({', '.join(sorted(steps)) or 'no rows'}) is one this "
                         f"weighs ({', '.join(prof.name for prof, _, _ in predictions)})")
    steps = None if steps is None else {**steps, "none": 1.0}
    return [Row(prof, p, baseline / p.step_s, convergence, None if steps is None else steps.get(prof.name),
                "HSDP" if hsdp else "DDP") for prof, convergence, p in predictions]


def eligible(rows: list[Row], biased: bool = False) -> list[Row]:
    """The rows a recommendation is made among: CONVERGES unless `biased`; with measured steps, the
    measured ones ("none" always is)."""
    rows = rows if biased else [r for r in rows if r.convergence in CONVERGES]
    if any(r.steps is not None and r.profile.name != "none" for r in rows):
        rows = [r for r in rows if r.steps is not None]
    return rows


# A lossier codec must be predicted this much faster to be chosen over a less lossy one: on the lab the
# model's ratio of two candidates' step times was off by up to 16% (low rank's 8-bit factors predicted
# 4-6% faster than fp32 factors, measured 10-20% slower: more, smaller collectives), and a lossier codec
# also takes more steps (8-bit factors 1.0-1.2x fp32 factors' steps to the target)
DEFAULT_TOLERANCE = 0.10


def recommend(rows: list[Row], tolerance: float = DEFAULT_TOLERANCE, biased: bool = False) -> Row:
    """The least lossy codec (most bytes on the wire per gradient element: HSDP's and DDP's rows compare
    as the codecs they run) within `tolerance` of the fastest, among the
    codecs that keep training on course (CONVERGES, and "none") unless `biased`. With measured steps
    (any row's `steps` set) the fastest is by time to target (Row.time_s), among measured codecs only:
    an unmeasured one would look as if it converged like fp32.

    Step time says nothing of convergence. An unbiased code keeps SGD's guarantees (its variance is
    bounded); low rank with error feedback matches SGD's accuracy at rank >= 2 (PowerSGD), and on
    bench/time_to_accuracy.py's cells rank 4 took 1.09-1.27x fp32's steps to its loss with fp32
    factors, 1.21-1.52x with 8-bit ones. A 16-bit cast rounds each element, and each addition of the
    sum, to within half a unit in the last place (2^-11 relative for fp16, 2^-8 for bf16): fp16 and
    bf16 took 0.97-0.99x fp32's steps there. A
    biased one (top-k, random-k) may need many more steps or never get there (random-k 1%,
    predicted at 10.3x fp32's step speed on the 100 Mbit/s cell, never reached fp32's loss).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance: must be >= 0, got {tolerance!r}")
    rows = eligible(rows, biased)
    best = min(r.time_s for r in rows)
    close = [r for r in rows if r.time_s <= best * (1 + tolerance)]
    return max(close, key=lambda r: (r.prediction.payload_bytes / r.prediction.elements, -r.time_s))


def format_table(rows: list[Row], chosen: Row) -> str:
    """The predictions as Markdown; bits/elem: payload (headers and factors included) per gradient element.
    With measured steps: steps to target (x fp32's) and the speedup in time to target."""
    measured = any(r.steps is not None for r in rows)
    head = ("| codec | bits/elem | collective | convergence | payload MB/step | comm s | codec s "
            "| exposed s | step s | speedup |" + (" steps x | to-target speedup |" if measured else ""))
    lines = [head, "|" + "---|" * (12 if measured else 10)]
    baseline = next(r.time_s for r in rows if r.profile.name == "none") if measured else None
    for r in rows:
        p = r.prediction
        mark = " **<-**" if r is chosen else ""
        line = (f"| {r.profile.name}{mark} | {8 * p.payload_bytes / p.elements:.3g} | {r.profile.collective} | "
                f"{r.convergence} | {p.payload_bytes / 1e6:.3g} | {p.comm_s:.4g} | "
                f"{p.encode_s + p.decode_s:.4g} | {p.exposed_comm_s:.4g} | {p.step_s:.4g} | "
                f"{r.speedup:.2f}x |")
        if measured:
            line += (" - | - |" if r.steps is None else
                     " never | 0.00x |" if math.isinf(r.steps) else f" {r.steps:.3g} | {baseline / r.time_s:.2f}x |")
        lines.append(line)
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="number of parameters, e.g. 7e9")
    size.add_argument("--model", help="a Hugging Face model folder (config.json and/or *.safetensors)")
    parser.add_argument("--workers", type=int, help="data-parallel world size of a flat cluster, every rank on "
                        "--link (with --nodes: optional, nodes x gpus per node)")
    parser.add_argument("--link", choices=tuple(net.PRESETS),
                        help=f"fabric preset (default {DEFAULT_LINK}); see netgain.cost.network.PRESETS")
    parser.add_argument("--bandwidth", help="custom link instead of --link: payload rate per rank "
                        "and direction (headers already taken off), e.g. 40gbit or 5GB/s")
    parser.add_argument("--latency", help="per-message latency, e.g. 30us (default: the preset's, "
                        "30us for --bandwidth)")
    nodes = parser.add_argument_group(
        "two-level cluster", "nodes of several GPUs, instead of --link/--bandwidth/--latency: prices DDP over all "
        "ranks (at the pace of the slowest hop, the node's NIC) and HSDP (FSDP inside a node, the replicas "
        "all-reducing each shard across nodes, with each codec netgain.comm.fsdp runs)")
    nodes.add_argument("--nodes", type=int, help="number of nodes, >= 1")
    nodes.add_argument("--gpus-per-node", type=int, help="ranks per node, >= 1")
    for level, where, default in (("intra", "between the GPUs of a node, per GPU",
                                   "the NVLink of --gpu: nvlink-h100 for h100 and h200, else nvlink-a100"),
                                  ("inter", "between nodes: one per node, its NIC shared by the node's GPUs",
                                   DEFAULT_LINK)):
        nodes.add_argument(f"--{level}-link", choices=tuple(net.PRESETS), help=f"fabric preset {where} (default {default})")
        nodes.add_argument(f"--{level}-bandwidth", help=f"custom link instead of --{level}-link, as --bandwidth")
        nodes.add_argument(f"--{level}-latency", help=f"its per-message latency, as --latency (default: the "
                           f"preset's, 30us for --{level}-bandwidth)")
    parser.add_argument("--gpu", choices=GPU_CHOICES,
                        help="what each rank runs on: sets the compute estimate and the codec cost "
                        "(default: the preset's, a100 for --bandwidth; cpu = this machine, as in "
                        "the lab presets)")
    parser.add_argument("--codec-cost", choices=("memory", *net.CODEC_COSTS),
                        help="encode/decode cost: memory = fused GPU kernels bound by HBM traffic, "
                        "calibrate = timed on this machine (on the largest bucket's shapes with --model; on cpu the codec's "
                        "work also takes the compute's cores), free = zero (default: memory on a GPU, "
                        "calibrate on cpu)")
    parser.add_argument("--compute-ms", type=float, help="forward+backward ms per step and rank, > 0 "
                        "(default: 6 * params * tokens / (peak * mfu) on --gpu)")
    parser.add_argument("--tokens-per-step", type=float, default=16384,
                        help="tokens per rank and step for the compute estimate, > 0 (default 16384)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="model FLOPs utilisation for the compute estimate, in (0, 1] (default 0.4)")
    parser.add_argument("--bucket-mb", type=float,
                        help="DDP bucket_cap_mb, > 0 (default: DDP's 25, with its 1 MiB first bucket)")
    parser.add_argument("--algorithm", choices=net.ALGORITHMS, default="auto",
                        help="native allreduce algorithm: ring, tree, or auto = what the link's "
                        "library runs: the faster per message as NCCL picks, gloo's ring on the lab "
                        "presets (default auto)")
    parser.add_argument("--allow-biased", action="store_true",
                        help="let the fixed codec (and on two levels the recommendation) be a biased one "
                        "(top-k/random-k), whose "
                        "convergence the step time does not show; default: unbiased codecs, 16-bit casts "
                        "and low rank with error feedback only")
    parser.add_argument("--steps-from", nargs="+", metavar="CSV",
                        help="measured steps to a target loss per codec (columns workers, codec, steps_ratio: "
                        "steps / fp32's; bench/time_to_accuracy.py's CSV has them): the fixed codec is then "
                        "by time to target, step time x steps, among the measured codecs (rows at --workers "
                        "where there are any; the median over cells; an empty steps_ratio means never reached)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="the fixed codec (and on two levels the recommendation): the least lossy within "
                        "this fraction of the fastest "
                        f"(default {DEFAULT_TOLERANCE}, >= 0)")


def model_buckets(shapes: list[tuple[int, ...]], bucket_mb: float,
                  first_mb: float) -> tuple[list[int], list[int], list[list[tuple[int, ...]]]]:
    """A model's DDP buckets from its parameter shapes (registration order): elements, parameters
    and shapes per bucket, in ready order."""
    buckets, tensors = map(list, zip(*net.ddp_bucket_layout([math.prod(s) for s in shapes], bucket_mb, first_mb)))
    return buckets, tensors, net.ddp_bucket_shapes(shapes, tensors)


def calibration_shapes(bucket_shapes: list[list[tuple[int, ...]]] | None, world_size: int) -> list[tuple[int, ...]] | None:
    """The model's own parameters to calibrate codecs on: the largest bucket's, in order, up to
    net.CALIBRATION_ELEMENTS / world_size elements (at least one); None without shapes (--params)."""
    if not bucket_shapes:
        return None
    largest = max(bucket_shapes, key=lambda shapes: sum(math.prod(s) for s in shapes))
    out, total = [], 0
    for shape in largest:
        if out and total + math.prod(shape) > net.CALIBRATION_ELEMENTS // world_size:
            break
        out.append(shape)
        total += math.prod(shape)
    return out


def bucket_caps(args) -> tuple[float, float]:
    """(bucket_mb, first bucket's MB) from --bucket-mb: like DDP, the small first bucket only with the default cap."""
    return (args.bucket_mb, args.bucket_mb) if args.bucket_mb else (DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB)


def require(ok: bool, flag: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{flag} {rule}, got {value}")


FLAT_LINK_FLAGS = ("--link", "--bandwidth", "--latency")
TWO_LEVEL_LINK_FLAGS = tuple(f"--{level}-{key}" for level in ("intra", "inter") for key in ("link", "bandwidth", "latency"))
INTRA_DEFAULTS = {"h100": "nvlink-h100", "h200": "nvlink-h100"}  # --gpu's NVLink; nvlink-a100 for the others


def _value(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def _given(args, flags) -> list[str]:
    return [flag for flag in flags if _value(args, flag) is not None]


def check_cluster(args) -> None:
    """A flat cluster (--workers, every rank on one link) or a two-level one (--nodes x --gpus-per-node, a link
    inside the nodes and one between them), each described by its own options only."""
    shape = _given(args, ("--nodes", "--gpus-per-node"))
    if not shape:
        if args.workers is None:
            raise ValueError("give --workers (a flat cluster, every rank on --link), or --nodes and --gpus-per-node "
                             "(nodes of several GPUs)")
        two_level = _given(args, TWO_LEVEL_LINK_FLAGS)
        if two_level:
            raise ValueError(f"{two_level[0]} {_value(args, two_level[0])} describes a two-level cluster: give --nodes "
                             "and --gpus-per-node with it")
        return
    if len(shape) == 1:
        raise ValueError(f"{shape[0]} {_value(args, shape[0])} needs its partner: a two-level cluster is --nodes x "
                         "--gpus-per-node, give both")
    flat = _given(args, FLAT_LINK_FLAGS)
    if flat:
        raise ValueError(f"{flat[0]} {_value(args, flat[0])} is a flat cluster's one link: with --nodes give "
                         "--intra-link and --inter-link (or --intra-bandwidth, --inter-bandwidth)")
    require(args.nodes >= 1, "--nodes", "must be at least 1", args.nodes)
    require(args.gpus_per_node >= 1, "--gpus-per-node", "must be at least 1", args.gpus_per_node)
    world = args.nodes * args.gpus_per_node
    require(args.workers in (None, world), "--workers", f"must be --nodes {args.nodes} x --gpus-per-node "
            f"{args.gpus_per_node} = {world} (or be left out)", args.workers)


def check_args(args) -> None:
    """Every number `netgain model` takes, named as on the command line, before any prediction."""
    require(args.workers is None or args.workers >= 1, "--workers", "must be at least 1", args.workers)
    check_cluster(args)
    if args.params is not None:
        require(math.isfinite(args.params) and args.params >= 1, "--params", "must be a finite number >= 1",
                args.params)
    for flag, value in (("--bucket-mb", args.bucket_mb), ("--compute-ms", args.compute_ms)):
        if value is not None:
            require(math.isfinite(value) and value > 0, flag, "must be a finite number > 0", value)
    if args.compute_ms is not None:
        require(args.compute_ms <= MAX_COMPUTE_MS, "--compute-ms", f"must be at most {MAX_COMPUTE_MS:g} (11.6 days a step)",
                args.compute_ms)
    if args.bucket_mb is not None:
        require(args.bucket_mb * 2**20 >= 4, "--bucket-mb", f"must hold one fp32 element (>= {4 / 2**20:.2g})",
                args.bucket_mb)
    if args.params is not None:
        buckets = net.even_bucket_count(args.params, *bucket_caps(args))
        require(buckets <= MAX_BUCKETS, "--params", f"over --bucket-mb makes {buckets:.3g} buckets: at most "
                f"{MAX_BUCKETS:,} are modelled (a larger --bucket-mb, or fewer --params)", args.params)
    require(math.isfinite(args.tokens_per_step) and args.tokens_per_step > 0, "--tokens-per-step",
            "must be a finite number > 0", args.tokens_per_step)
    require(0 < args.mfu <= 1, "--mfu", "must be in (0, 1]", args.mfu)
    require(math.isfinite(args.tolerance) and args.tolerance >= 0, "--tolerance", "must be a finite number >= 0",
            args.tolerance)


def resolve_cluster(args) -> tuple[net.Cluster | None, net.Link, str]:
    """(the two-level cluster, None for a flat one; the link DDP's collectives run at; the device usually
    attached: the one the link inside the nodes connects)."""
    if args.nodes is None:
        return (None, *resolve_link(args))
    intra, device = resolve_link(args, "intra", INTRA_DEFAULTS.get(args.gpu, "nvlink-a100"))
    cluster = net.Cluster(args.nodes, args.gpus_per_node, intra, resolve_link(args, "inter")[0])
    return cluster, cluster.flat_link(), device


def link_line(label: str, link: net.Link, algorithm: str, per: str = "rank") -> str:
    algorithm = link.algorithm if algorithm == "auto" else algorithm
    return (f"{label}: {link.name} ({link.note}): {link.bandwidth / 1e9:.4g} GB/s per {per}, "
            f"{link.latency * 1e6:.3g} us per message, {link.overhead * 1e6:.3g} us per collective"
            f"{f', {link.burst / 1e3:.4g} kB shaper burst' if link.burst else ''}, {algorithm} allreduce")


def run(args) -> int:
    check_args(args)
    cluster, link, device = resolve_cluster(args)
    workers = cluster.world_size if cluster else args.workers
    steps = read_steps(args.steps_from, workers) if args.steps_from else None
    gpu = GPUS.get(args.gpu or device)
    cost_name = args.codec_cost or ("memory" if gpu else "calibrate")
    if cost_name == "memory" and gpu is None:
        raise ValueError("--codec-cost memory needs a GPU (--gpu a100|h100)")
    cost = gpu if cost_name == "memory" else cost_name
    if args.compute_ms is None and gpu is None:
        raise ValueError("on cpu (--gpu cpu, or a lab --link) give --compute-ms: there is no FLOP-rate estimate for CPUs")

    shapes = count_parameters(args.model, args.model_types) if args.model else None
    sizes = [math.prod(shape) for shape in shapes] if shapes else None
    params = sum(sizes) if sizes else args.params
    if params < 1:
        raise ValueError(f"--model {args.model} has no parameters")
    bucket_mb, first_mb = bucket_caps(args)
    if sizes:
        buckets, tensors, bucket_shapes = model_buckets(shapes, bucket_mb, first_mb)
    else:  # as if made of square cap-sized matrices
        buckets, tensors, bucket_shapes = net.even_buckets(params, bucket_mb, first_mb), None, None
    if args.compute_ms is not None:
        compute_s, compute_note = args.compute_ms / 1e3, "given"
    else:
        compute_s = net.estimate_compute_s(params, args.tokens_per_step, gpu, args.mfu)
        compute_note = (f"estimated: 6 x {params:.3g} params x {args.tokens_per_step:g} tokens "
                        f"/ ({gpu.name} {gpu.peak_flops / 1e12:g} TFLOP/s x {args.mfu})")
        if not compute_s * 1e3 <= MAX_COMPUTE_MS:
            raise ValueError(f"--tokens-per-step and --mfu give {compute_s * 1e3:.3g} ms of compute per step ({compute_note}), "
                             f"more than {MAX_COMPUTE_MS:g} ms (11.6 days): give smaller --tokens-per-step, a larger "
                             "--mfu, or --compute-ms")

    profiles = args.codec_profiles(workers, cost, calibration_shapes(bucket_shapes, workers))
    priced = dict(algorithm=args.algorithm, tensors=tensors, shapes=bucket_shapes, codec_shares_compute=gpu is None,
                  steps=steps)
    rows = evaluate(buckets, workers, link, compute_s, profiles, **priced)
    nodes = f"{cluster.nodes} node{'s' * (cluster.nodes > 1)} x {cluster.gpus_per_node} GPUs = " if cluster else ""
    print(f"model: {params:.4g} parameters in {len(buckets)} buckets of about {bucket_mb:g} MiB; {nodes}{workers} workers")
    if cluster:
        print(link_line("inside a node", cluster.intra, args.algorithm))
        print(link_line("between nodes", cluster.inter, args.algorithm,
                        f"node (its NIC, shared by its {cluster.gpus_per_node} GPUs)"))
    else:
        print(link_line("link", link, args.algorithm))
    print(f"compute: {compute_s * 1e3:.4g} ms per step ({compute_note}); codec cost: {cost_name}"
          f"{' (' + gpu.name + ' HBM)' if cost_name == 'memory' else ''}")
    print()
    if cluster:
        # one node: FSDP alone, with no hop across nodes for a codec to take
        hsdp_profiles = (args.hsdp_profiles(cluster.nodes, cost, calibration_shapes(bucket_shapes, cluster.nodes))
                         if cluster.nodes > 1 else [p for p in profiles if p[0].name == "none"])
        fp32_ddp = next(r for r in rows if r.profile.name == "none").prediction.step_s
        hsdp = evaluate(buckets, cluster.nodes, link, compute_s, hsdp_profiles, **priced, hsdp=cluster, baseline_s=fp32_ddp)
        print(routes_report(rows, hsdp, cluster, args.tolerance, args.allow_biased))
    else:
        print(flat_report(rows, args.tolerance, args.allow_biased))
    forecast = args.auto_plan(buckets, bucket_shapes, workers, link, compute_s, cost)
    # the recommendation: on one level what auto would run (its own planner's solve), on two the route and codec
    recommended_s = (recommend(rows + hsdp, args.tolerance, args.allow_biased).time_s if cluster
                     else forecast["step_s"] * forecast["steps"])
    fp32_row = next(r for r in rows if r.profile.name == "none")
    routes = [("DDP", workers, None)] + ([("HSDP", cluster.nodes, cluster)] if cluster and cluster.nodes > 1 else [])
    for route, world, two_level in routes:
        local = args.local_route(world, cost)
        step = price_local(buckets, tensors, workers, link, compute_s, local, two_level, algorithm=args.algorithm,
                           codec_shares_compute=gpu is None)
        print(local_line(route, local, step, fp32_row, recommended_s))
    print(("" if cluster else "recommendation: ") + auto_forecast(forecast))
    return 0


def price_local(buckets: list[int], tensors: list[int] | None, world_size: int, link: net.Link, compute_s: float,
                local: LocalSteps, hsdp: net.Cluster | None = None, **options) -> net.Prediction:
    """Local steps' step (net.predict_local): DDP's compute alone, or under HSDP each node's FSDP step with nothing
    across nodes; and the average of the whole model (one flat tensor, as netgain.sync sends it) across the ranks,
    or under HSDP each rank's shard across the nodes. ``options``: net.predict's (algorithm, codec_shares_compute)."""
    total, count = sum(buckets), [sum(tensors)] if tensors else None
    if hsdp:
        step = net.predict_hsdp(buckets, dataclasses.replace(hsdp, nodes=1), compute_s=compute_s, **options)
        sync = net.predict([math.ceil(total / hsdp.gpus_per_node)], hsdp.nodes, hsdp.replica_link(), local.profile,
                           tensors=count, **options)
    else:
        step = net.predict(buckets, 1, link, compute_s=compute_s, **options)
        sync = net.predict([total], world_size, link, local.profile, tensors=count, **options)
    return net.predict_local(step, sync, local.period, local.overlap_steps)


def local_line(route: str, local: LocalSteps, step: net.Prediction, fp32_ddp: Row, recommended_s: float) -> str:
    """Local steps on ``route`` against fp32 DDP and the recommendation (``recommended_s``: its time to the target)."""
    to_target = step.step_s * local.steps
    return (f"local steps, {route} (netgain.sync: {local.profile.name} every {local.period} steps; --local-route offers "
            f"them to auto, --sync runs them): predicted step {step.step_s:.4g} s and {local.steps:.3g}x fp32's steps "
            f"to the target ({local.measured}): {fp32_ddp.time_s / to_target:.2f}x sooner than fp32 DDP, "
            f"{recommended_s / to_target:.2f}x than the recommendation")


def flat_report(rows: list[Row], tolerance: float, biased: bool) -> str:
    """The codecs' table and the fixed codec chosen among them, for a run that pins one (the recommendation is
    auto's plan: `run`)."""
    chosen = recommend(rows, tolerance, biased)
    measured = any(r.steps is not None for r in rows)
    to_target = f", {chosen.steps:.3g}x its steps to the target" if chosen.steps is not None else ""
    if chosen.profile.name == "none":
        best = min((r for r in eligible(rows, biased) if r is not chosen), key=lambda r: r.time_s, default=chosen)
        line = (f"fixed codec: no compression (no codec is more than {tolerance:.0%} faster"
                f"{' to the target' if measured else ''}; best: {best.profile.name} at "
                f"{chosen.time_s / best.time_s:.2f}x{' to the target' if measured else ' the step speed'})")
    else:
        line = (f"fixed codec: {chosen.profile.name} "
                f"({chosen.speedup:.2f}x the step speed of no compression{to_target})")
    return f"{format_table(rows, chosen)}\n\n{line}"


def routes_report(ddp: list[Row], hsdp: list[Row], cluster: net.Cluster, tolerance: float, biased: bool) -> str:
    """A two-level cluster's tables, DDP's and HSDP's, and the route recommended among both (recommend: the
    least lossy within `tolerance` of the fastest), against fp32 DDP and DDP with PowerSGD r4."""
    chosen = recommend(ddp + hsdp, tolerance, biased)
    g, flat, shared = cluster.gpus_per_node, cluster.flat_link(), cluster.replica_link()
    measure = "sooner to the target than" if chosen.steps is not None else "the step speed of"
    versus = [f"{r.time_s / chosen.time_s:.2f}x {measure} {label}" for label, name in
              (("fp32 DDP", "none"), ("DDP with PowerSGD r4", POWERSGD_R4)) for r in ddp if r.profile.name == name]
    codec = ("no compression" if chosen.profile.name == "none" else
             chosen.profile.name + (" across nodes" if chosen.route == "HSDP" else ""))
    across = (f"the {cluster.nodes} replicas all-reduce each rank's 1/{g} shard across nodes, a node's {g} shards at "
              f"once through its NIC ({shared.bandwidth / 1e9:.4g} GB/s each), with the codecs netgain.comm.fsdp runs"
              if cluster.nodes > 1 else "one node: FSDP alone, no replicas to all-reduce")
    return "\n".join([
        f"DDP: each collective spans all {cluster.world_size} ranks, a ring (or tree) at the pace of its slowest hop "
        f"({flat.bandwidth / 1e9:.4g} GB/s, {flat.latency * 1e6:.3g} us per message)",
        format_table(ddp, chosen), "",
        f"HSDP: FSDP shards each bucket over a node's {g} GPUs on {cluster.intra.name} (gradients reduce-scattered, "
        f"parameters all-gathered in the forward and again in the backward); {across}; speedup against fp32 DDP",
        format_table(hsdp, chosen), "",
        f"recommendation: {chosen.route}, {codec} ({', '.join(versus)})"])


POWERSGD_R4 = "lowrank(rank=4,factors=fp32)"  # PowerSGD r4's bytes and steps: netgain's low rank r4 with fp32 factors


def auto_forecast(forecast: dict) -> str:
    """What `auto` (netgain train's and register's default) would run, from its planner's own solve
    (AdaptivePlanner.plan_ahead), and its time to the target against fp32 DDP's and PowerSGD r4's. Its
    steps to the target are those auto prices each option with (LOWRANK_STEPS for low rank), measured on
    bench/time_to_accuracy.py's grid; its step counts every collective as exposed, as auto does."""
    counts = collections.Counter(forecast["plan"])
    plan = ", ".join(f"{codec} on {n} bucket{'s' * (n > 1)}" for codec, n in counts.most_common())
    to_target = forecast["step_s"] * forecast["steps"]
    versus = [f"{(s * k) / to_target:.2f}x sooner than {name} ({s:.4g} s a step, {k:.3g}x the steps)"
              for name, (s, k) in (("fp32 DDP", forecast["options"]["none"]),
                                   ("PowerSGD r4", forecast["options"][POWERSGD_R4]))]
    return (f"auto (the default) would run: {plan}; predicted step {forecast['step_s']:.4g} s and "
            f"{forecast['steps']:.3g}x fp32's steps to the target (measured on the lab grid): to the target "
            f"{versus[0]}, {versus[1]}. In a run it tries the plans priced within 1.5x of the best and keeps the "
            f"fastest measured.")
