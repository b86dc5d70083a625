"""Analytic latency of GEMMs and attention on NVIDIA GPUs, with the alignment cliffs compressed LLMs hit.

A model, not a measurement: it predicts how latency moves with a layer's size on a GPU this
machine does not have (A100 / H100 / H200, FP16/BF16). It encodes the mechanisms GAC measured
(../shared/papers/gac.md): the cuBLAS kernel tier chosen by K and N alignment (%8 native, even -> align2,
odd -> align1), the tensor-core k-step (K % 16), GEMV bandwidth loss when K % 8 != 0, tile and
wave quantisation (a tile grid just past a multiple of the SM count runs one more, nearly empty
wave), FlashAttention's compiled head-dim templates and SDPA's fallback to the math kernel when
head_dim % 8 != 0. Around the kernels, `netgain.cost.latency` adds HF's eager per-layer work
(norms, activation, rotary embedding, residual adds) as memory-bound kernels.

Three constants are fitted (bench/gac_a100.py) to the paper's five A100 rows, each priced at the
sequence length its authors' script timed, and its figure's three S=512 bars (`netgain.cost.published`):
the native GEMM's fraction of peak, the align1 tier's efficiency, and the K % 16 tier's within the
paper's "up to ~70%" (it lands on that bound). align2 is the paper's measured ~30% penalty (one
pruner row cannot tell align2 from align1). The fitted values agree with the paper's root-cause
throughputs: a native kernel at K, N = 4096 lands near 175 TFLOPS once tile and wave losses apply,
an align1 kernel near 60 (the paper: 160-175 and 50-110). H100 and H200 reuse the A100 fit with
their own datasheet peaks. `netgain profile` measures the real thing on the current device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_PER_ELEMENT = 2  # FP16 / BF16
# (tile rows, tile cols, relative efficiency): bigger tiles reuse operands better; cuBLAS's
# heuristic picks among several, so the model takes the fastest.
TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.92), (128, 64, 0.8), (64, 128, 0.8), (64, 64, 0.6))
GEMV_UNALIGNED_BANDWIDTH = 0.88  # decode GEMV with K % 8 != 0: ~12% slower
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
FLASH_EFFICIENCY = 0.55  # fraction of tensor peak FlashAttention-2 sustains
MATH_SDPA_PASSES = 4  # the math kernel writes and re-reads the score matrix (scale, mask, softmax, matmul)
# HF's eager RMSNorm upcasts to fp32 and runs one kernel per operation: to(fp32), pow, mean, +eps and
# rsqrt, multiply, to(fp16), times the weight; in element-passes of an fp16-sized tensor (fp32 counts twice)
NORM_KERNELS, NORM_PASSES = 7, 9
ACTIVATION_KERNELS, ACTIVATION_PASSES = 2, 2.5  # act(gate), then * up (two reads, one write)
STREAMING_EFFICIENCY = 0.8  # fraction of peak HBM bandwidth an elementwise kernel reaches


@dataclass(frozen=True)
class GPU:
    """What the model needs to know about a GPU."""

    name: str
    sms: int
    tensor_tflops: float  # dense FP16/BF16 tensor-core peak
    memory_gbps: float
    efficiency: float = 0.695  # fitted: fraction of peak a well-shaped native GEMM reaches end to end
    launch_us: float = 4.0
    preferred_multiple: int = 16  # the tensor-core k-step (m16n8k16)
    # cuBLAS kernel tiers by the alignment of K and N: fraction of the native kernel's throughput
    native_k8: float = 0.59  # fitted, at the paper's bound: K % 8 == 0 but K % 16 != 0 (half-empty m16n8k16 k-steps)
    align2: float = 0.769  # CUTLASS align2 kernels (even K and N): the paper's ~30% penalty (1 / 1.3)
    align1: float = 0.34  # fitted: CUTLASS align1 kernels (odd K or N); the paper: 50-110 vs 160-175 TFLOPS

    @property
    def peak_flops(self) -> float:
        return self.tensor_tflops * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Bytes/s of HBM."""
        return self.memory_gbps * 1e9

    def tier_efficiency(self, tier: str) -> float:
        return {"native": 1.0, "native-k8": self.native_k8, "align2": self.align2, "align1": self.align1}[tier]


GPUS = {  # the one GPU spec table (datasheets): the kernel model and the network model read it
    "a100": GPU("NVIDIA A100-SXM4-80GB", sms=108, tensor_tflops=312.0, memory_gbps=2039.0),
    "h100": GPU("NVIDIA H100-SXM5-80GB", sms=132, tensor_tflops=989.0, memory_gbps=3350.0),
    "h200": GPU("NVIDIA H200-SXM-141GB", sms=132, tensor_tflops=989.0, memory_gbps=4800.0),
}


def gemm_tier(k: int, n: int) -> str:
    """The cuBLAS kernel family a (., K) x (K, N) product lands on."""
    if k % 8 == 0 and n % 8 == 0:
        return "native" if k % 16 == 0 else "native-k8"
    if k % 2 == 0 and n % 2 == 0:
        return "align2"
    return "align1"


class AnalyticCost:
    """Predicted latency (seconds) of the kernels of one transformer forward on a preset GPU."""

    def __init__(self, gpu: GPU | str):
        if isinstance(gpu, str):
            if gpu not in GPUS:
                raise ValueError(f"gpu must be one of {sorted(GPUS)} or a GPU, got {gpu!r}")
            gpu = GPUS[gpu]
        self.gpu = gpu
        self.name = gpu.name
        self.preferred_multiple = gpu.preferred_multiple
        self.noise = 0.0  # a model has no measurement noise: every predicted difference counts
        self.host_bound = False  # kernel launches run ahead of the GPU: framework time hides behind it

    def gemm(self, m: int, k: int, n: int) -> float:
        """(M x K) @ (K x N): the slower of tensor-core compute (tiles, waves, tier) and memory traffic."""
        _check_dims(m=m, k=k, n=n)
        gpu = self.gpu
        per_sm_flops = gpu.tensor_tflops * 1e12 * gpu.efficiency / gpu.sms
        tier = gpu.tier_efficiency(gemm_tier(k, n))
        compute = min(
            math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / gpu.sms) * 2 * tm * tn * k / (per_sm_flops * eff * tier)
            for tm, tn, eff in TILES
        )
        bandwidth = gpu.memory_gbps * 1e9 * (1.0 if k % 8 == 0 else GEMV_UNALIGNED_BANDWIDTH)
        memory = (m * k + k * n + m * n) * BYTES_PER_ELEMENT / bandwidth
        return max(compute, memory) + gpu.launch_us * 1e-6

    def sdpa(self, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool = True) -> float:
        """Scaled dot-product attention: FlashAttention at the next head-dim template, or the math fallback."""
        _check_dims(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
        gpu = self.gpu
        causal_fraction = 0.5 if causal and q_len == kv_len and q_len > 1 else 1.0
        if head_dim % 8 == 0 and head_dim <= FLASH_HEAD_DIMS[-1]:
            padded = next(d for d in FLASH_HEAD_DIMS if d >= head_dim)
            flops = 4 * batch * heads * q_len * kv_len * padded * causal_fraction
            compute = flops / (gpu.tensor_tflops * 1e12 * FLASH_EFFICIENCY)
            memory = batch * heads * (2 * q_len + 2 * kv_len) * head_dim * BYTES_PER_ELEMENT / (gpu.memory_gbps * 1e9)
            return max(compute, memory) + gpu.launch_us * 1e-6
        # math kernel: two batched GEMMs plus the materialised score matrix
        products = batch * heads * (self.gemm(q_len, head_dim, kv_len) + self.gemm(q_len, kv_len, head_dim))
        scores = MATH_SDPA_PASSES * batch * heads * q_len * kv_len * BYTES_PER_ELEMENT / (gpu.memory_gbps * 1e9)
        return products + scores

    def norm(self, module, shape: tuple[int, ...]) -> float:
        """HF's eager RMSNorm on `shape`: a chain of memory-bound kernels."""
        return self._streaming(math.prod(shape), NORM_PASSES, NORM_KERNELS)

    def activation(self, module, shape: tuple[int, ...]) -> float:
        """act(gate) * up on `shape`: two memory-bound kernels."""
        return self._streaming(math.prod(shape), ACTIVATION_PASSES, ACTIVATION_KERNELS)

    def elementwise(self, numel: int, passes: float = 1) -> float:
        """`passes` kernels, each reading and writing `numel` elements."""
        return self._streaming(numel, passes, math.ceil(passes))

    def framework(self, calls: int, ops: int) -> float:
        """0: the host issues later kernels while the GPU runs earlier ones (`host_bound` is False)."""
        return 0.0

    def _streaming(self, numel: int, passes: float, kernels: int) -> float:
        gpu = self.gpu
        seconds = passes * 2 * numel * BYTES_PER_ELEMENT / (gpu.memory_gbps * 1e9 * STREAMING_EFFICIENCY)
        return seconds + kernels * gpu.launch_us * 1e-6


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
