"""Network performance model: when does gradient compression shorten a data-parallel step?

Alpha-beta costs of the collectives a codec needs, the codec's own encode/decode time, and the
overlap of communication with the backward pass, as DDP does it: gradients are grouped into
buckets that become ready in reverse layer order; bucket k's communication (encode, collective,
decode) starts when its gradients are ready and bucket k-1's is done. Whatever communication is
still running when the backward ends is exposed and lengthens the step.

Units: bytes, seconds, bytes per second. `bandwidth` is the payload rate one rank can send in one
direction (what a ring uses); `latency` (alpha) is the fixed cost of one message/step; `overhead`
the fixed cost of one collective call (the library's dispatch and thread hand-offs), which makes
small collectives, netgain's per-bucket header among them, latency-bound at 1 Gbit/s and above.
A token-bucket shaper (the lab's `tc tbf`) lets `burst` bytes through at once after an idle
spell; predict() follows how full the bucket is from one collective to the next.
Nodes of several GPUs (Cluster): DDP over every rank runs at the pace of the node's NIC, and
predict_hsdp prices HSDP, FSDP inside the node and the replicas' all-reduce of a shard across nodes.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .kernels import GPU

# TCP/IPv4 payload per full-size frame at MTU 1500 (1448 bytes with timestamps) over what counts
# against the limit: a whole Ethernet frame on a physical wire (1538 bytes incl. preamble and
# inter-frame gap), or the L2 frame (1514 bytes) that `tc tbf` meters on a veth.
TCP_OVER_ETHERNET = 1448 / 1538
TCP_OVER_SHAPED_VETH = 1448 / 1514


ALGORITHMS = ("auto", "ring", "tree")  # auto: the fabric's choice (Link.algorithm)
LINK_ALGORITHMS = ("fastest", "ring")    # fastest: ring or tree per message, as NCCL's tuner picks


@dataclass(frozen=True)
class Link:
    """A data-parallel fabric as alpha-beta: per-message latency and per-rank payload bandwidth.

    overhead: seconds per collective call; burst: bytes a token-bucket shaper passes at once after
    idling (0: no shaper); algorithm: what the fabric's library runs for an allreduce asked for
    "auto": "fastest" of ring and tree (NCCL), or always "ring" (gloo on CPU tensors: torch passes
    gloo no algorithm and gloo::allreduce then runs its ring, allreduce.cc).
    """

    name: str
    bandwidth: float
    latency: float
    note: str = ""
    overhead: float = 0.0
    burst: float = 0.0
    algorithm: str = "fastest"

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth: must be > 0 bytes/s, got {self.bandwidth!r}")
        if not 0 <= self.latency < math.inf:
            raise ValueError(f"latency: must be finite and >= 0 s, got {self.latency!r}")
        if not (self.overhead >= 0 and self.burst >= 0):
            raise ValueError(f"overhead/burst: must be >= 0, got {self.overhead!r}/{self.burst!r}")
        if self.algorithm not in LINK_ALGORITHMS:
            raise ValueError(f"algorithm: a link runs one of {', '.join(LINK_ALGORITHMS)}, "
                             f"got {self.algorithm!r}")

    @classmethod
    def from_rate(cls, name: str, bits_per_s: float, latency: float,
                  efficiency: float = TCP_OVER_ETHERNET, note: str = "") -> "Link":
        """A link given by its line rate; `efficiency` is the payload share after headers."""
        return cls(name, bits_per_s / 8 * efficiency, latency, note)



# Fabric presets. Bandwidths are per GPU and per direction, taken as 80% of the nominal rate
# (what NCCL-style rings typically reach), latency is a per-step figure of the transport.
#  - NVLink 3 (A100): 12 links x 25 GB/s per direction = 300 GB/s ("600 GB/s" bidirectional).
#  - NVLink 4 (H100): 18 links, 900 GB/s bidirectional = 450 GB/s per direction.
#  - PCIe without peer-to-peer: every hop is staged through host memory (device-to-host copy,
#    then host-to-device), so a ring gets about half of the x16 link: Gen4 x16 31.5 GB/s raw,
#    Gen5 x16 63 GB/s raw, times 0.8, halved.
#  - Cloud Ethernet: line rate times the TCP payload share at MTU 1500; 30 us per message is a
#    typical same-placement-group TCP latency.
PRESETS = {
    "nvlink-a100": (Link("nvlink-a100", 0.8 * 300e9, 5e-6,
                         "NVLink 3, A100 SXM: 300 GB/s per direction x 0.8; 5 us"), "a100"),
    "nvlink-h100": (Link("nvlink-h100", 0.8 * 450e9, 5e-6,
                         "NVLink 4, H100 SXM: 450 GB/s per direction x 0.8; 5 us"), "h100"),
    "pcie4": (Link("pcie4", 0.8 * 31.5e9 / 2, 10e-6,
                   "PCIe 4.0 x16 without P2P, staged via host: 31.5 GB/s x 0.8 / 2; 10 us"), "a100"),
    "pcie5": (Link("pcie5", 0.8 * 63e9 / 2, 10e-6,
                   "PCIe 5.0 x16 without P2P, staged via host: 63 GB/s x 0.8 / 2; 10 us"), "h100"),
    "10gbe": (Link.from_rate("10gbe", 10e9, 30e-6,
                             note="10 GbE, TCP at MTU 1500 (94% payload); 30 us"), "a100"),
    "25gbe": (Link.from_rate("25gbe", 25e9, 30e-6,
                             note="25 GbE, TCP at MTU 1500 (94% payload); 30 us"), "a100"),
    "100gbe": (Link.from_rate("100gbe", 100e9, 30e-6,
                              note="100 GbE, TCP at MTU 1500 (94% payload); 30 us"), "a100"),
}


# The throttled-network lab (bench/lab.py) on this CPU machine: gloo over veths shaped by tbf.
# Its links are fitted to gloo collectives timed alone on the lab (bench/lab_collectives.py writes
# the samples next to this file); see fit_lab.
LAB_CALIBRATION = Path(__file__).with_name("lab_collectives.json")
LAB_RATES = ("100mbit", "1gbit")
SMALL_BYTES = 1024  # a collective of at most this many bytes per rank is all latency


def lab_preset_name(rate: str) -> str:
    return f"lab-{rate}"


def _messages_and_sent(op: str, nbytes: float, n: int) -> tuple[float, float]:
    """Latency steps and bytes sent per rank of a gloo ring allreduce / allgather."""
    if op == "allgather":
        return n - 1, (n - 1) * nbytes
    return 2 * (n - 1), 2 * (n - 1) / n * nbytes


def _slope(groups: Mapping[object, Sequence[tuple[float, float]]]) -> float:
    """Least-squares slope of y on x with an intercept of its own for each group."""
    num = den = 0.0
    for points in groups.values():
        mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
        num += sum((x - mx) * (y - my) for x, y in points)
        den += sum((x - mx) ** 2 for x, _ in points)
    if den <= 0:
        raise ValueError("fit_lab: needs two sizes (or world sizes) to fit a slope")
    return num / den


def fit_lab(samples: Sequence[Mapping], rate: str) -> Link:
    """A gloo Link fitted to timed collectives at one lab rate.

    samples: dicts of rate, op (allreduce, allreduce_max, allgather), workers, bytes (per rank),
    gap_s (the pause before it: > 0 means the shaper was full, 0 drained) and seconds.
    - overhead, latency: t = overhead + ring steps x latency, least squares over the small ones
      after a pause (n = 2 and 3 tell the two apart);
    - bandwidth: the slope of t against the bytes a rank sends, over the large ones with the
      shaper drained (one intercept per op and world size: fixed costs cancel);
    - burst: what the shaper passed at once: the bytes the largest ones after a pause sent beyond
      what their whole time accounts for at that bandwidth (median; a large collective's fixed
      costs overlap its paced transfer). Against the drained ones instead, it would miss what the
      shaper refilled during their barriers.
    """
    rows = [r for r in samples if r["rate"] == rate]
    if not rows:
        raise ValueError(f"fit_lab: no samples at rate {rate!r}")
    small = {0: [(_messages_and_sent(r["op"], r["bytes"], r["workers"])[0], r["seconds"])
                 for r in rows if r["bytes"] <= SMALL_BYTES and r["gap_s"]]}
    latency = max(0.0, _slope(small))
    overhead = max(0.0, statistics.fmean(t for _, t in small[0]) - latency * statistics.fmean(m for m, _ in small[0]))
    drained: dict = {}
    for r in rows:
        if not r["gap_s"] and r["bytes"] > SMALL_BYTES:
            drained.setdefault((r["op"], r["workers"]), []).append(
                (_messages_and_sent(r["op"], r["bytes"], r["workers"])[1], r["seconds"]))
    bandwidth = 1 / _slope(drained)
    largest = max(r["bytes"] for r in rows if r["gap_s"])
    burst = statistics.median(max(0.0, _messages_and_sent(r["op"], r["bytes"], r["workers"])[1]
                                  - r["seconds"] * bandwidth)
                              for r in rows if r["gap_s"] and r["bytes"] == largest)
    note = (f"bench/lab.py at {rate} (tbf on veth, gloo), fitted to {len(rows)} timed collectives "
            f"({LAB_CALIBRATION.name})")
    return Link(lab_preset_name(rate), bandwidth, latency, note, overhead, burst, "ring")


def lab_collective_s(op: str, nbytes: float, n: int, link: Link, tokens: float = 0.0) -> float:
    """The model's time of one calibration collective (op as in fit_lab) on a lab link."""
    if op == "allgather":
        return allgather_s(nbytes, n, link, tokens)
    return allreduce_s(nbytes, n, link, "ring", tokens)


def _lab_presets() -> dict:
    samples = json.loads(LAB_CALIBRATION.read_text())["samples"]
    return {lab_preset_name(rate): (fit_lab(samples, rate), "cpu") for rate in LAB_RATES}


PRESETS.update(_lab_presets())


def preset(name: str) -> Link:
    """The Link of a named fabric preset."""
    if name not in PRESETS:
        raise ValueError(f"link: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name][0]


def preset_device(name: str) -> str:
    """What a preset's fabric usually connects: a key of kernels.GPUS, or "cpu" for the lab."""
    preset(name)
    return PRESETS[name][1]


@dataclass(frozen=True)
class Cluster:
    """Two-level data parallelism: `nodes` of `gpus_per_node` ranks each. `intra` links the ranks of a node (per
    rank, as a flat cluster's Link); `inter` is one node's network port (its NIC), shared by all of its ranks.

    Why the NIC counts once per node: NCCL threads its rings (and trees) over every rank through the nodes, so
    each ring leaves and enters a node once and carries a rank's whole share of the traffic over the NIC, and
    each ring step waits for its slowest hop (flat_link). HSDP's all-reduces across nodes are one per shard,
    gpus_per_node of them at once through the same NIC (replica_link).
    """

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def flat_link(self) -> Link:
        """What a collective over every rank (DDP's) runs at: a ring through all ranks, each step as slow as its
        slowest hop, so the lower bandwidth and the higher latency and call overhead of the two links (gloo's
        ring only if either link is gloo's). One node: its own link; one rank per node: the network."""
        if self.nodes == 1:
            return self.intra
        if self.gpus_per_node == 1:
            return self.inter
        slow = min(self.intra, self.inter, key=lambda link: link.bandwidth)
        ring = "ring" in (self.intra.algorithm, self.inter.algorithm)
        return replace(slow, name=f"{self.intra.name} + {self.inter.name}",
                       latency=max(self.intra.latency, self.inter.latency),
                       overhead=max(self.intra.overhead, self.inter.overhead), algorithm="ring" if ring else "fastest",
                       note=f"a ring through all {self.world_size} ranks, at the pace of its slowest hop, {slow.name}")

    def replica_link(self) -> Link:
        """What each of a node's gpus_per_node concurrent all-reduces across nodes (HSDP's, one per shard) gets:
        an equal share of the NIC, and of its shaper's burst."""
        g = self.gpus_per_node
        return replace(self.inter, name=f"{self.inter.name} / {g}", bandwidth=self.inter.bandwidth / g,
                       burst=self.inter.burst / g, note=f"{self.inter.name} shared by a node's {g} shards")


_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)"


def parse_bandwidth(text: str, name: str = "bandwidth") -> float:
    """Bytes/s from a rate: bits in '25gbit', '25Gb/s', '25Gbps'; bytes in '12GB/s', '12GBps'.

    As in network specs, a lower-case b is a bit and an upper-case B a byte ('10Gb/s' is 1.25 GB/s);
    the prefix (k, M, G, T, decimal) takes either case. `name`: what errors call it (a CLI flag).
    """
    m = re.fullmatch(_NUMBER + r"\s*([kKmMgGtT]?)((?i:bit(?:/s)?)|b/s|bps|B/s|Bps)", text.strip())
    if not m:
        raise ValueError(f"{name}: cannot parse {text!r}; use e.g. '25gbit', '100Mb/s' (bits) or '12GB/s' "
                         "(bytes: an upper-case B)")
    if m.group(3) == "b/s" and m.group(2).islower():  # netgain read '12gb/s' as bytes before 2026-12-04
        raise ValueError(f"{name}: {text!r} is ambiguous: write {m.group(1)}{m.group(2).upper()}b/s or "
                         f"{m.group(1)}{m.group(2)}bit for bits, {m.group(1)}{m.group(2).upper()}B/s for bytes")
    rate = float(m.group(1)) * _PREFIXES[m.group(2).lower()] / (1 if m.group(3) in ("B/s", "Bps") else 8)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"{name}: must be a finite rate > 0, got {text!r}")
    return rate


def parse_duration(text: str, name: str = "latency") -> float:
    """Seconds from '30us', '1.5ms', '0.2s'; `name`: what errors call it."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"{name}: cannot parse {text!r}; use e.g. '30us', '1ms' (units "
                         f"{', '.join(_TIME_UNITS)})")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"{name}: must be finite, got {text!r}")
    return seconds


def check_world(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size: must be an integer >= 1, got {n!r}")


def paced_s(messages: float, sent: float, link: Link, tokens: float = 0.0) -> float:
    """One collective call: overhead, `messages` latencies, and the `sent` bytes of this rank that
    the shaper's `tokens` (bytes it would pass at once) do not cover, at the link's bandwidth."""
    return link.overhead + messages * link.latency + max(0.0, sent - tokens) / link.bandwidth


def ring_allreduce_s(nbytes: float, n: int, link: Link, tokens: float = 0.0) -> float:
    """Ring allreduce (reduce-scatter + allgather): 2(n-1) alpha + 2(n-1)/n S/beta."""
    check_world(n)
    return paced_s(2 * (n - 1), 2 * (n - 1) / n * nbytes, link, tokens) if n > 1 else 0.0


def tree_allreduce_s(nbytes: float, n: int, link: Link, combine_s: float = 0.0,
                     tokens: float = 0.0) -> float:
    """Binary-tree reduce then broadcast: 2 ceil(log2 n) (alpha + S/beta) + one combine per level."""
    check_world(n)
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    if not levels:
        return 0.0
    return paced_s(2 * levels, 2 * levels * nbytes, link, tokens) + levels * combine_s


def allgather_s(nbytes_per_rank: float, n: int, link: Link, tokens: float = 0.0) -> float:
    """Ring allgather of S bytes from every rank: (n-1) alpha + (n-1) S/beta."""
    check_world(n)
    return paced_s(n - 1, (n - 1) * nbytes_per_rank, link, tokens) if n > 1 else 0.0


def ring_combine_allreduce_s(nbytes: float, n: int, link: Link, combine_s: float,
                             tokens: float = 0.0) -> float:
    """Ring reduce-scatter with a custom combine, then allgather.

    `combine_s` is the time to combine two whole S-byte payloads; each of the n-1 reduce-scatter
    hops combines one 1/n chunk, on the critical path. Every hop is a call of its own (n - 1
    overheads), and so is the allgather.
    """
    check_world(n)
    if n == 1:
        return 0.0
    return ring_allreduce_s(nbytes, n, link, tokens) + (n - 1) * (link.overhead + combine_s / n)


COLLECTIVES = ("allreduce", "allgather", "ring")
# netgain's per-bucket header (comm/hooks.py, _header): one allreduce MAX of float32
# [max |g| of each of the bucket's P parameters, non-finite flag, signature, -signature]
# (random-k: the picked coordinates' max too, 2P; a codec profile's header_bytes_per_tensor says).
HEADER_FLAG_BYTES = 12
HEADER_BYTES_PER_TENSOR = 4
HEADER_BYTES = HEADER_FLAG_BYTES + HEADER_BYTES_PER_TENSOR  # a one-parameter bucket's header


@dataclass(frozen=True)
class CodecProfile:
    """What the model needs to know about one codec at one world size.

    wire_bits: payload bits per gradient element each rank contributes; collective: 'allreduce'
    (summable payload), 'allgather' (every rank decodes everyone's payload) or 'ring' (ring
    reduce-scatter with a custom combine, then allgather); header_bytes + header_bytes_per_tensor
    x (parameters in the bucket): a small allreduce per bucket before the payload (netgain's
    global scales), 0 for none; per-element seconds of encode, decode and of one combine of two
    whole payloads (ring only). rank > 0: low rank (PowerSGD), whose payload depends on the
    parameters' shapes: each matrix it compresses sends rows x rank then cols x rank factor
    elements of `wire_bits` each, in two allreduces (see low_rank_messages); factor_scales: Global-QSGD
    factors, one scale per factor column: P's in the header (rank per compressed matrix, one per other
    parameter), Q's in a MAX allreduce of rank floats per compressed matrix between the rounds.
    """

    name: str
    wire_bits: float
    collective: str = "allreduce"
    header_bytes: int = 0
    encode_s_per_elem: float = 0.0
    decode_s_per_elem: float = 0.0
    combine_s_per_elem: float = 0.0
    header_bytes_per_tensor: int = 0
    rank: int = 0
    factor_scales: bool = False

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective: must be one of {', '.join(COLLECTIVES)}, "
                             f"got {self.collective!r}")
        if not self.wire_bits > 0:
            raise ValueError(f"wire_bits: must be > 0, got {self.wire_bits!r}")
        if self.rank and self.collective != "allreduce":
            raise ValueError(f"rank: low-rank factors travel by allreduce, got collective {self.collective!r}")

    def header_size(self, tensors: int = 1) -> int:
        """Bytes of the header allreduce of a bucket holding `tensors` parameters (0: no header)."""
        if not (self.header_bytes or self.header_bytes_per_tensor):
            return 0
        return self.header_bytes + self.header_bytes_per_tensor * tensors


UNCOMPRESSED = CodecProfile("none", 32.0)


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")


def allreduce_algorithm(nbytes: float, n: int, link: Link, algorithm: str = "auto") -> str:
    """"ring" or "tree": what runs an S-byte allreduce asked for `algorithm` on `link`."""
    _check_algorithm(algorithm)
    if algorithm != "auto":
        return algorithm
    if link.algorithm == "ring":
        return "ring"
    return "tree" if tree_allreduce_s(nbytes, n, link) < ring_allreduce_s(nbytes, n, link) else "ring"


def allreduce_s(nbytes: float, n: int, link: Link, algorithm: str = "auto",
                tokens: float = 0.0) -> float:
    """A native allreduce by `algorithm`; "auto" runs what the link's library runs (Link.algorithm)."""
    if allreduce_algorithm(nbytes, n, link, algorithm) == "tree":
        return tree_allreduce_s(nbytes, n, link, tokens=tokens)
    return ring_allreduce_s(nbytes, n, link, tokens)


def sent_bytes(nbytes: float, n: int, collective: str, link: Link, algorithm: str = "auto") -> float:
    """Bytes one rank puts on its link in a collective of an S-byte payload per rank."""
    if n == 1:
        return 0.0
    if collective == "allgather":
        return (n - 1) * nbytes
    if collective == "allreduce" and allreduce_algorithm(nbytes, n, link, algorithm) == "tree":
        return 2 * math.ceil(math.log2(n)) * nbytes
    return 2 * (n - 1) / n * nbytes


LOW_RANK_MIN_COMPRESSION = 2  # low rank compresses a matrix only if its factors are at most half of it (PowerSGD's rule)


def low_rank_compresses(rows: float, cols: float, rank: int) -> bool:
    """Whether rank-`rank` factors of a rows x cols matrix are worth sending instead of the matrix."""
    return rank * (rows + cols) * LOW_RANK_MIN_COMPRESSION <= rows * cols


def as_matrix(shape: Sequence[float]) -> tuple[float, float]:
    """(rows, cols) of a parameter as PowerSGD sees it (dim 0 by the rest), (0, 0) for a vector."""
    if len(shape) < 2 or not shape[0]:
        return (0, 0)
    return (shape[0], math.prod(shape[1:]))


def low_rank_messages(shapes: Sequence[Sequence[int]], codec: CodecProfile, tensors: int) -> list[tuple[str, float]]:
    """A low-rank codec's collectives for one bucket of `tensors` parameters with these shapes: the header
    (Global-QSGD factors: one scale per column of P, so rank per compressed matrix and one per other
    parameter), P (every compressed matrix's rows x rank, every other parameter whole), [Q's column
    scales,] Q."""
    p, q, matrices = 0.0, 0.0, 0
    for shape in shapes:
        rows, cols = as_matrix(shape)
        if rows and low_rank_compresses(rows, cols, codec.rank):
            p, q, matrices = p + rows * codec.rank, q + cols * codec.rank, matrices + 1
        else:
            p += math.prod(shape)
    columns = (codec.rank - 1) * matrices if codec.factor_scales else 0
    header = codec.header_size(tensors + columns)
    out = [("allreduce", header)] if header else []
    if not matrices:
        return out + [("allreduce", p * codec.wire_bits / 8)]
    scales = [4 * matrices * codec.rank] if codec.factor_scales else []
    return out + [("allreduce", nbytes) for nbytes in (p * codec.wire_bits / 8, *scales, q * codec.wire_bits / 8)]


def square_shapes(numel: float, tensors: int) -> list[tuple[float, float]]:
    """A bucket's shapes when only its size is known: `tensors` equal square matrices."""
    side = math.sqrt(numel / tensors)
    return [(side, side)] * tensors


def bucket_messages(numel: int, codec: CodecProfile, tensors: int = 1,
                    shapes: Sequence[Sequence[int]] | None = None) -> list[tuple[str, float]]:
    """(collective, payload bytes per rank) of a bucket's collectives in order: header (if any), payload(s).

    shapes: the bucket's parameter shapes, which size a low-rank codec's factors (square_shapes
    if not given)."""
    if codec.rank:
        return low_rank_messages(shapes or square_shapes(numel, tensors), codec, tensors)
    header = codec.header_size(tensors)
    return ([("allreduce", header)] if header else []) + [(codec.collective, numel * codec.wire_bits / 8)]


def bucket_collectives(numel: int, world_size: int, link: Link, codec: CodecProfile,
                       algorithm: str = "auto", tensors: int = 1, tokens: float = 0.0,
                       shapes: Sequence[Sequence[int]] | None = None) -> list[tuple[float, float]]:
    """(seconds, bytes this rank sends) of a bucket's collectives in order (see bucket_messages).

    `tokens`: what the link's shaper would pass at once when the first of them starts; each
    collective drains what it sends and refills at the link's rate while it runs.
    """
    _check_algorithm(algorithm)
    out = []
    for collective, nbytes in bucket_messages(numel, codec, tensors, shapes):
        if collective == "allgather":
            seconds = allgather_s(nbytes, world_size, link, tokens)
        elif collective == "ring":
            seconds = ring_combine_allreduce_s(nbytes, world_size, link, numel * codec.combine_s_per_elem, tokens)
        else:
            seconds = allreduce_s(nbytes, world_size, link, algorithm, tokens)
        sent = sent_bytes(nbytes, world_size, collective, link, algorithm)
        out.append((seconds, sent))
        tokens = refill(tokens, sent, seconds, link)
    return out


def refill(tokens: float, sent: float, seconds: float, link: Link) -> float:
    """The shaper's tokens after `seconds` during which this rank sent `sent` bytes."""
    if link.bandwidth == math.inf:  # a fitted link whose bytes cost no measurable time: 0 s x inf is no refill
        return link.burst
    return min(link.burst, max(0.0, tokens - sent + seconds * link.bandwidth))


def collective_s(numel: int, world_size: int, link: Link, codec: CodecProfile,
                 algorithm: str = "auto", tensors: int = 1, tokens: float = 0.0,
                 shapes: Sequence[Sequence[int]] | None = None) -> float:
    """Time on the wire for one bucket of `numel` gradient elements under `codec` (with header).

    `algorithm` applies to native allreduces (header and summable payloads); allgather and the
    custom-combine ring have one algorithm each. `tensors`: parameters in the bucket (the header
    holds one float each); `tokens`, `shapes`: see bucket_collectives.
    """
    return sum(s for s, _ in bucket_collectives(numel, world_size, link, codec, algorithm, tensors, tokens, shapes))


def payload_bytes(numel: int, codec: CodecProfile, tensors: int = 1,
                  shapes: Sequence[Sequence[int]] | None = None) -> float:
    """Bytes this rank hands to the collectives for one bucket (what `netgain train` records)."""
    return sum(nbytes for _, nbytes in bucket_messages(numel, codec, tensors, shapes))


def ddp_bucket_layout(tensor_numels: Sequence[int], bucket_mb: float = 25.0,
                      first_bucket_mb: float = 1.0, bytes_per_elem: int = 4) -> list[tuple[int, int]]:
    """(elements, parameters) per DDP-style bucket, in the order they become ready.

    `tensor_numels` lists parameters in forward (registration) order; gradients become ready in
    reverse. Like DDP's rebuilt buckets (reducer.cpp, compute_bucket_assignment_by_size), a tensor
    joins the open bucket, which closes once it reaches its cap: `first_bucket_mb` for the first
    (earliest-ready) bucket, `bucket_mb` after.
    """
    if bucket_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(f"bucket_mb/first_bucket_mb: must be > 0, got {bucket_mb}/{first_bucket_mb}")
    caps = [first_bucket_mb * 2**20, bucket_mb * 2**20]
    buckets: list[tuple[int, int]] = []
    current = count = 0
    for numel in reversed(tensor_numels):
        current, count = current + numel, count + 1
        if current * bytes_per_elem >= caps[min(len(buckets), 1)]:
            buckets.append((current, count))
            current = count = 0
    if count:
        buckets.append((current, count))
    return buckets


def ddp_bucket_shapes(shapes: Sequence[Sequence[int]], tensors: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """Each bucket's parameter shapes, from shapes in registration order and ddp_bucket_layout's counts."""
    ready = [tuple(shape) for shape in reversed(shapes)]
    if sum(tensors) != len(ready):
        raise ValueError(f"tensors: the buckets hold {sum(tensors)} parameters, the shapes are of {len(ready)}")
    starts = [sum(tensors[:i]) for i in range(len(tensors))]
    return [ready[start:start + count] for start, count in zip(starts, tensors)]


def ddp_buckets(tensor_numels: Sequence[int], bucket_mb: float = 25.0,
                first_bucket_mb: float = 1.0, bytes_per_elem: int = 4) -> list[int]:
    """Element counts of DDP-style buckets in ready order (see ddp_bucket_layout)."""
    return [numel for numel, _ in ddp_bucket_layout(tensor_numels, bucket_mb, first_bucket_mb, bytes_per_elem)]


def _even_split(params: float, bucket_mb: float, first_bucket_mb: float, bytes_per_elem: int) -> tuple[int, int, int, int]:
    """(first bucket, cap, count of cap-sized buckets, tail) of a model known only by its parameter count."""
    if params < 1:
        raise ValueError(f"params: must be >= 1, got {params!r}")
    cap = int(bucket_mb * 2**20 / bytes_per_elem)
    first = min(int(first_bucket_mb * 2**20 / bytes_per_elem), int(params))
    full, tail = divmod(int(params) - first, cap)
    return first, cap, full, tail


def even_buckets(params: float, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 bytes_per_elem: int = 4) -> list[int]:
    """Buckets of a model known only by its parameter count: as if made of cap-sized tensors."""
    first, cap, full, tail = _even_split(params, bucket_mb, first_bucket_mb, bytes_per_elem)
    return [first] + [cap] * full + ([tail] if tail else [])


def even_bucket_count(params: float, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                      bytes_per_elem: int = 4) -> int:
    """len(even_buckets(...)), without building the list."""
    _, _, full, tail = _even_split(params, bucket_mb, first_bucket_mb, bytes_per_elem)
    return 1 + full + (1 if tail else 0)


@dataclass(frozen=True)
class Prediction:
    """One predicted training step of one rank.

    comm_s: time on the wire summed over buckets (as if nothing overlapped; FSDP's gathers and
    reduce-scatters included); encode_s/decode_s: codec work; exposed_comm_s: how far the step runs
    past the compute alone; elements: the gradient elements the payload encodes (a shard's under HSDP).
    """

    codec: str
    step_s: float
    compute_s: float
    comm_s: float
    encode_s: float
    decode_s: float
    exposed_comm_s: float
    payload_bytes: float
    buckets: int
    elements: float = 0.0


def predict(buckets: Sequence[int] | float, world_size: int, link: Link,
            codec: CodecProfile = UNCOMPRESSED, compute_s: float = 0.0,
            backward_fraction: float = 2 / 3, algorithm: str = "auto",
            bucket_mb: float = 25.0, tensors: Sequence[int] | None = None,
            shapes: Sequence[Sequence[Sequence[int]]] | None = None,
            codec_shares_compute: bool = False, stage_s: Sequence[float] | None = None,
            gather_s: float = 0.0) -> Prediction:
    """Predict one data-parallel step.

    `buckets`: element counts per bucket in ready order (see ddp_buckets), or a parameter count
    (split with even_buckets). `tensors`: parameters per bucket (ddp_bucket_layout), which size
    the header; one each if not given. `shapes`: each bucket's parameter shapes (ddp_bucket_shapes),
    which size low-rank factors; square matrices if not given. `compute_s`: forward + backward time of one rank without
    communication; its last `backward_fraction` is the backward, during which buckets become
    ready in proportion to their size. As in netgain's hook, one communication worker handles the
    buckets in order: encode, header, collective, decode; bucket k starts when it is ready and
    bucket k-1 is done. The step ends when both the backward and the last bucket are done.
    `codec_shares_compute`: the codec's work runs on the cores the compute uses (a CPU worker's
    threads already fill its share of the cores; on the lab the hook's encode ran 2-3x its time
    alone), so it lengthens the compute by its own time as well as taking the worker's. The
    link's shaper starts the step full (the previous step's compute refilled it).
    HSDP (predict_hsdp) adds `stage_s`: seconds of a collective of each bucket's own on another link
    and stream before the codec's (the reduce-scatter inside the node), which runs once the bucket is
    ready and bucket k-1's is done; and `gather_s`: the parameter all-gathers of one pass, each
    prefetched during the compute before it, so a pass takes the longer of its compute and its gathers.
    """
    check_world(world_size)
    if not 0 < backward_fraction <= 1:
        raise ValueError(f"backward_fraction: must be in (0, 1], got {backward_fraction!r}")
    if compute_s < 0 or gather_s < 0:
        raise ValueError(f"compute_s/gather_s: must be >= 0, got {compute_s!r}/{gather_s!r}")
    if isinstance(buckets, (int, float)):
        buckets = even_buckets(buckets, bucket_mb)
    tensors = [1] * len(buckets) if tensors is None else list(tensors)
    shapes = [None] * len(buckets) if shapes is None else list(shapes)
    stage_s = [0.0] * len(buckets) if stage_s is None else list(stage_s)
    for name, given in (("tensors", tensors), ("shapes", shapes), ("stage_s", stage_s)):
        if len(given) != len(buckets):
            raise ValueError(f"{name}: one per bucket, got {len(given)} for {len(buckets)} buckets")
    total = sum(buckets)
    sends = world_size > 1  # one rank alone sends nothing and runs no codec
    if not (sends or gather_s or any(stage_s)):
        return Prediction(codec.name, compute_s, compute_s, 0.0, 0.0, 0.0, 0.0, 0.0, len(buckets), total)
    backward = max(compute_s * backward_fraction, gather_s)
    busy_s = max(compute_s - compute_s * backward_fraction, gather_s) + backward
    if codec_shares_compute and sends:
        shared = total * (codec.encode_s_per_elem + codec.decode_s_per_elem)
        busy_s, backward = busy_s + shared, backward + shared * backward_fraction
    ready = busy_s - backward
    done = staged = 0.0
    tokens, idle_from = link.burst, 0.0
    comm, encode, decode, sent = sum(stage_s) + 2 * gather_s, 0.0, 0.0, 0.0
    memo = {}  # equal buckets met with equal tokens (a --params model's cap-sized ones) cost the same
    for numel, count, bucket_shapes, stage in zip(buckets, tensors, shapes, stage_s):
        ready += backward * numel / total
        staged = max(ready, staged) + stage
        enc, dec = (numel * codec.encode_s_per_elem, numel * codec.decode_s_per_elem) if sends else (0.0, 0.0)
        start = max(staged, done) + enc
        tokens = refill(tokens, 0.0, start - idle_from, link)
        key = (numel, count, tokens)
        cost = memo.get(key) if bucket_shapes is None else None
        if cost is None:
            wire, left = 0.0, tokens
            for seconds, out in (bucket_collectives(numel, world_size, link, codec, algorithm, count, tokens,
                                                    bucket_shapes) if sends else ()):
                left = refill(left, out, seconds, link)
                wire += seconds
            cost = wire, left, payload_bytes(numel, codec, count, bucket_shapes) if sends else 0.0
            if bucket_shapes is None:
                memo[key] = cost
        wire, tokens, payload = cost
        done = idle_from = start + wire
        done += dec
        comm, encode, decode = comm + wire, encode + enc, decode + dec
        sent += payload
    step = max(busy_s, done)
    return Prediction(codec.name, step, compute_s, comm, encode, decode,
                      step - compute_s, sent, len(buckets), total)


def predict_hsdp(buckets: Sequence[int] | float, cluster: Cluster, codec: CodecProfile = UNCOMPRESSED,
                 compute_s: float = 0.0, bucket_mb: float = 25.0,
                 shapes: Sequence[Sequence[Sequence[int]]] | None = None, **options) -> Prediction:
    """One HSDP step: FSDP2 shards each bucket (taken as one FSDP group) over the ranks of a node, and the
    nodes' replicas all-reduce each rank's shard through `codec` (predict on the shards, `options` as its).

    Inside the node (cluster.intra): a ring reduce-scatter of each group's fp32 gradient before its
    all-reduce (stage_s), and ring all-gathers of its fp32 parameters in the forward and again in the
    backward (gather_s; FSDP2 reshards after the forward). A reduce-scatter moves what the all-gather of
    its output does. Across nodes: 1/gpus_per_node of the gradient per rank over cluster.replica_link().
    """
    g = cluster.gpus_per_node
    if isinstance(buckets, (int, float)):
        buckets = even_buckets(buckets, bucket_mb)
    shards = [math.ceil(numel / g) for numel in buckets]
    moves = [allgather_s(4 * shard, g, cluster.intra) for shard in shards]
    if shapes is not None:  # FSDP2 shards dim 0
        shapes = [[(math.ceil(s[0] / g), *s[1:]) if s else s for s in bucket] for bucket in shapes]
    return predict(shards, cluster.nodes, cluster.replica_link(), codec, compute_s, shapes=shapes,
                   stage_s=moves, gather_s=sum(moves), **options)


def predict_local(step: Prediction, sync: Prediction, period: int, overlap_steps: int = 1) -> Prediction:
    """Local steps (netgain.sync, DiLoCo's shape): every step is `step`, with nothing crossing the replicas, and
    every `period` steps one average of the parameters, `sync` (predicted alone, no compute), launched after a
    step and applied `overlap_steps` steps later: what it takes beyond those steps is exposed, over the period."""
    if period < 1 or overlap_steps < 0:
        raise ValueError(f"period/overlap_steps: must be >= 1/>= 0, got {period!r}/{overlap_steps!r}")
    exposed = max(0.0, sync.step_s - overlap_steps * step.step_s) / period
    return Prediction(f"{sync.codec} every {period} steps", step.step_s + exposed, step.compute_s,
                      step.comm_s + sync.comm_s / period, step.encode_s + sync.encode_s / period,
                      step.decode_s + sync.decode_s / period, step.exposed_comm_s + exposed,
                      sync.payload_bytes / period, step.buckets, sync.elements)


def estimate_compute_s(params: float, tokens_per_step: float, gpu: GPU, mfu: float = 0.4) -> float:
    """Forward+backward time of a transformer step: 6 * params * tokens FLOPs at `mfu` of peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: must be in (0, 1], got {mfu!r}")
    return 6 * params * tokens_per_step / (gpu.peak_flops * mfu)


CODEC_COSTS = ("calibrate", "free")
CALIBRATION_ELEMENTS = 2**22  # a calibrated codec is timed on a bucket of this many elements / world size


def memory_bound_cost(wire_bits: float, collective: str, world_size: int, needs_header: bool,
                      memory_bandwidth: float) -> tuple[float, float, float]:
    """Per-element (encode, decode, combine) seconds of fused GPU kernels bound by memory traffic.

    Assumed traffic per element: encode reads the fp32 gradient (twice when a global max is taken
    first) and writes the payload; decode reads the payload (all n under allgather) and writes
    fp32; a ring combine reads two payloads and writes one.
    """
    payload = wire_bits / 8
    reads = world_size if collective == "allgather" else 1
    encode = (4 * (2 if needs_header else 1) + payload) / memory_bandwidth
    decode = (reads * payload + 4) / memory_bandwidth
    combine = 3 * payload / memory_bandwidth if collective == "ring" else 0.0
    return encode, decode, combine
