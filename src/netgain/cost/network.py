"""Network performance model: when does gradient compression shorten a data-parallel step?

Alpha-beta costs of the collectives a codec needs, the codec's own encode/decode time, and the
overlap of communication with the backward pass, as DDP does it: gradients are grouped into
buckets that become ready in reverse layer order; bucket k's communication (encode, collective,
decode) starts when its gradients are ready and bucket k-1's is done. Whatever communication is
still running when the backward ends is exposed and lengthens the step.

Units: bytes, seconds, bytes per second. `bandwidth` is the payload rate one rank can send in one
direction (what a ring uses); `latency` (alpha) is the fixed cost of one message/step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .kernels import GPU

# TCP/IPv4 payload per full-size frame at MTU 1500 (1448 bytes with timestamps) over what counts
# against the limit: a whole Ethernet frame on a physical wire (1538 bytes incl. preamble and
# inter-frame gap), or the L2 frame (1514 bytes) that `tc tbf` meters on a veth.
TCP_OVER_ETHERNET = 1448 / 1538
TCP_OVER_SHAPED_VETH = 1448 / 1514


@dataclass(frozen=True)
class Link:
    """A data-parallel fabric as alpha-beta: per-message latency and per-rank payload bandwidth."""

    name: str
    bandwidth: float
    latency: float
    note: str = ""

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth: must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"latency: must be >= 0 s, got {self.latency!r}")

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
    # The throttled-network lab (bench/lab.py) on a CPU machine: tbf meters L2 frames on a veth;
    # 100 us per message is half a 4-byte gloo all_reduce between two lab workers (85-113 us
    # measured, bench/results/lab_allreduce.md).
    "lab-100mbit": (Link.from_rate("lab-100mbit", 100e6, 100e-6, TCP_OVER_SHAPED_VETH,
                                   "bench/lab.py at 100 Mbit/s (tbf on veth)"), "cpu"),
    "lab-1gbit": (Link.from_rate("lab-1gbit", 1e9, 100e-6, TCP_OVER_SHAPED_VETH,
                                 "bench/lab.py at 1 Gbit/s (tbf on veth)"), "cpu"),
}


def preset(name: str) -> Link:
    """The Link of a named fabric preset."""
    if name not in PRESETS:
        raise ValueError(f"link: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name][0]


def preset_device(name: str) -> str:
    """What a preset's fabric usually connects: a key of kernels.GPUS, or "cpu" for the lab."""
    preset(name)
    return PRESETS[name][1]


_BIT_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTE_UNITS = {"b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)"


def parse_bandwidth(text: str) -> float:
    """Bytes/s from '25gbit' (bits/s units: bit, kbit, mbit, gbit) or '12GB/s' (bytes/s units)."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z/]+)", text.strip().lower())
    if m and m.group(2) in _BIT_UNITS:
        return float(m.group(1)) * _BIT_UNITS[m.group(2)] / 8
    if m and m.group(2) in _BYTE_UNITS:
        return float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    raise ValueError(f"bandwidth: cannot parse {text!r}; use e.g. '25gbit', '100mbit' or '12GB/s'")


def parse_duration(text: str) -> float:
    """Seconds from '30us', '1.5ms', '0.2s'."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"latency: cannot parse {text!r}; use e.g. '30us', '1ms' (units "
                         f"{', '.join(_TIME_UNITS)})")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def check_world(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size: must be an integer >= 1, got {n!r}")


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring allreduce (reduce-scatter + allgather): 2(n-1) alpha + 2(n-1)/n S/beta."""
    check_world(n)
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def tree_allreduce_s(nbytes: float, n: int, link: Link, combine_s: float = 0.0) -> float:
    """Binary-tree reduce then broadcast: 2 ceil(log2 n) (alpha + S/beta) + one combine per level."""
    check_world(n)
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    return 2 * levels * (link.latency + nbytes / link.bandwidth) + levels * combine_s


def allgather_s(nbytes_per_rank: float, n: int, link: Link) -> float:
    """Ring allgather of S bytes from every rank: (n-1) alpha + (n-1) S/beta."""
    check_world(n)
    return (n - 1) * (link.latency + nbytes_per_rank / link.bandwidth)


def ring_combine_allreduce_s(nbytes: float, n: int, link: Link, combine_s: float) -> float:
    """Ring reduce-scatter with a custom combine, then allgather.

    `combine_s` is the time to combine two whole S-byte payloads; each of the n-1 reduce-scatter
    hops combines one 1/n chunk, on the critical path.
    """
    check_world(n)
    return ring_allreduce_s(nbytes, n, link) + (n - 1) * combine_s / n


COLLECTIVES = ("allreduce", "allgather", "ring")
ALGORITHMS = ("auto", "ring", "tree")  # auto: the faster per message, as NCCL's tuner picks
HEADER_BYTES = 16  # netgain's per-bucket header allreduce MAX: (3 + parameters) floats, latency-bound; modelled as 4


@dataclass(frozen=True)
class CodecProfile:
    """What the model needs to know about one codec at one world size.

    wire_bits: payload bits per gradient element each rank contributes; collective: 'allreduce'
    (summable payload), 'allgather' (every rank decodes everyone's payload) or 'ring' (ring
    reduce-scatter with a custom combine, then allgather); header_bytes: a small allreduce per
    bucket before the payload (netgain's global scale); per-element seconds of encode, decode
    and of one combine of two whole payloads (ring only).
    """

    name: str
    wire_bits: float
    collective: str = "allreduce"
    header_bytes: int = 0
    encode_s_per_elem: float = 0.0
    decode_s_per_elem: float = 0.0
    combine_s_per_elem: float = 0.0

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective: must be one of {', '.join(COLLECTIVES)}, "
                             f"got {self.collective!r}")
        if not self.wire_bits > 0:
            raise ValueError(f"wire_bits: must be > 0, got {self.wire_bits!r}")


UNCOMPRESSED = CodecProfile("none", 32.0)


def allreduce_s(nbytes: float, n: int, link: Link, algorithm: str = "auto") -> float:
    """A native allreduce by `algorithm`; "auto" takes the faster of ring and tree."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "ring":
        return ring_allreduce_s(nbytes, n, link)
    if algorithm == "tree":
        return tree_allreduce_s(nbytes, n, link)
    return min(ring_allreduce_s(nbytes, n, link), tree_allreduce_s(nbytes, n, link))


def collective_s(numel: int, world_size: int, link: Link, codec: CodecProfile,
                 algorithm: str = "auto") -> float:
    """Time on the wire for one bucket of `numel` gradient elements under `codec` (with header).

    `algorithm` applies to native allreduces (header and summable payloads); allgather and the
    custom-combine ring have one algorithm each.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    header = allreduce_s(codec.header_bytes, world_size, link, algorithm) if codec.header_bytes else 0.0
    nbytes = numel * codec.wire_bits / 8
    if codec.collective == "allgather":
        return header + allgather_s(nbytes, world_size, link)
    if codec.collective == "ring":
        combine = numel * codec.combine_s_per_elem
        return header + ring_combine_allreduce_s(nbytes, world_size, link, combine)
    return header + allreduce_s(nbytes, world_size, link, algorithm)


def payload_bytes(numel: int, codec: CodecProfile) -> float:
    """Bytes this rank hands to the collectives for one bucket (what `netgain train` records)."""
    return numel * codec.wire_bits / 8 + codec.header_bytes


def ddp_buckets(tensor_numels: Sequence[int], bucket_mb: float = 25.0,
                first_bucket_mb: float = 1.0, bytes_per_elem: int = 4) -> list[int]:
    """Group gradients into DDP-style buckets, in the order they become ready.

    `tensor_numels` lists parameters in forward (registration) order; gradients become ready in
    reverse. Like DDP's rebuilt buckets (reducer.cpp, compute_bucket_assignment_by_size), a tensor
    joins the open bucket, which closes once it reaches its cap: `first_bucket_mb` for the first
    (earliest-ready) bucket, `bucket_mb` after. Returns element counts per bucket.
    """
    if bucket_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(f"bucket_mb/first_bucket_mb: must be > 0, got {bucket_mb}/{first_bucket_mb}")
    caps = [first_bucket_mb * 2**20, bucket_mb * 2**20]
    buckets: list[int] = []
    current = 0
    for numel in reversed(tensor_numels):
        current += numel
        if current * bytes_per_elem >= caps[min(len(buckets), 1)]:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def even_buckets(params: float, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 bytes_per_elem: int = 4) -> list[int]:
    """Buckets of a model known only by its parameter count: as if made of cap-sized tensors."""
    if params < 1:
        raise ValueError(f"params: must be >= 1, got {params!r}")
    cap = int(bucket_mb * 2**20 / bytes_per_elem)
    first = min(int(first_bucket_mb * 2**20 / bytes_per_elem), int(params))
    rest = int(params) - first
    full, tail = divmod(rest, cap)
    return [first] + [cap] * full + ([tail] if tail else [])


@dataclass(frozen=True)
class Prediction:
    """One predicted training step of one rank.

    comm_s: time on the wire summed over buckets (as if nothing overlapped); encode_s/decode_s:
    codec work; exposed_comm_s: how far the step runs past the end of the backward pass.
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


def predict(buckets: Sequence[int] | float, world_size: int, link: Link,
            codec: CodecProfile = UNCOMPRESSED, compute_s: float = 0.0,
            backward_fraction: float = 2 / 3, algorithm: str = "auto",
            bucket_mb: float = 25.0) -> Prediction:
    """Predict one data-parallel step.

    `buckets`: element counts per bucket in ready order (see ddp_buckets), or a parameter count
    (split with even_buckets). `compute_s`: forward + backward time of one rank without
    communication; its last `backward_fraction` is the backward, during which buckets become
    ready in proportion to their size. As in netgain's hook, one communication worker handles the
    buckets in order: encode, header, collective, decode; bucket k starts when it is ready and
    bucket k-1 is done. The step ends when both the backward and the last bucket are done.
    """
    check_world(world_size)
    if not 0 < backward_fraction <= 1:
        raise ValueError(f"backward_fraction: must be in (0, 1], got {backward_fraction!r}")
    if compute_s < 0:
        raise ValueError(f"compute_s: must be >= 0, got {compute_s!r}")
    if isinstance(buckets, (int, float)):
        buckets = even_buckets(buckets, bucket_mb)
    if world_size == 1:
        return Prediction(codec.name, compute_s, compute_s, 0.0, 0.0, 0.0, 0.0, 0.0, len(buckets))
    total = sum(buckets)
    backward = compute_s * backward_fraction
    ready = compute_s - backward
    done = 0.0
    comm = encode = decode = sent = 0.0
    for numel in buckets:
        ready += backward * numel / total
        enc, dec = numel * codec.encode_s_per_elem, numel * codec.decode_s_per_elem
        wire = collective_s(numel, world_size, link, codec, algorithm)
        done = max(ready, done) + enc + wire + dec
        comm, encode, decode = comm + wire, encode + enc, decode + dec
        sent += payload_bytes(numel, codec)
    step = max(compute_s, done)
    return Prediction(codec.name, step, compute_s, comm, encode, decode,
                      step - compute_s, sent, len(buckets))


def estimate_compute_s(params: float, tokens_per_step: float, gpu: GPU, mfu: float = 0.4) -> float:
    """Forward+backward time of a transformer step: 6 * params * tokens FLOPs at `mfu` of peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: must be in (0, 1], got {mfu!r}")
    return 6 * params * tokens_per_step / (gpu.peak_flops * mfu)


CODEC_COSTS = ("calibrate", "free")


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
