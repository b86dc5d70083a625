"""Codec throughput on a GPU as a fraction of its memory bandwidth, and the hook on CUDA at world size 1.

Why: on a GPU a fused codec should run at memory speed. Each codec's encode + decode of one bucket
is timed (CUDA-synchronised, median of repeats, compiled by Triton unless NETGAIN_COMPILE=0) and
set against a device-to-device copy of the same bucket measured in the same run. Bytes moved per
element are the minimum a fused codec needs (netgain.cost.network.memory_bound_cost: the gradient
read for the header max and again for the encode, the payload written and read back, the fp32
result written), so `of copy bandwidth` says how close the codec runs to the memory limit.

    python bench/gpu_codecs.py [--numel 67108864] [--out DIR]     # on the GPU machine (bench/gpu_codecs.sh)
    python bench/gpu_codecs.py --dry-run                         # CPU smoke test of the same path
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

import netgain.comm as comm
from netgain.comm.calibrate import bucket_wire_bits, time_codec
from netgain.comm.config import SETTINGS, make_codec
from netgain.cost import network


def copy_bandwidth(numel: int, device: str, repeats: int) -> float:
    """Bytes/s of a device copy (read + write) of numel fp32."""
    x, y = torch.randn(numel, device=device), torch.empty(numel, device=device)
    times = []
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 8 * numel / sorted(times[1:])[repeats // 2]


def hook_at_world_size_one(device: str) -> dict:
    """The hook registered on a CUDA DDP model at world size 1 (it passes through): steps run, statistics come."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = comm.register(ddp, comm.GlobalQSGDConfig(bits=8))
    for _ in range(3):
        ddp(torch.randn(64, 512, device=device)).square().mean().backward()
    state.close()
    dist.destroy_process_group()
    return {"steps": len(state.history), "buckets": state.last_step["buckets"],
            "grad_finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 26)
    parser.add_argument("--world-size", type=int, default=8, help="n the codes are laid out for")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small bucket: checks the path, not the GPU")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run for the CPU smoke test)")
    numel = 1 << 16 if args.dry_run else args.numel
    bandwidth = copy_bandwidth(numel, device, args.repeats)
    rows = []
    for name, params in SETTINGS:
        codec = make_codec(name, **params)
        t = time_codec(codec, numel, args.world_size, repeats=args.repeats, parameters=16, device=device)
        enc, dec, comb = network.memory_bound_cost(bucket_wire_bits(codec, numel, args.world_size, 16), codec.collective,
                                                   args.world_size, codec.needs_scales, 1.0)
        moved = (enc + dec) * numel  # bytes, at "1 byte/s": the per-element traffic model
        seconds = t["encode_s"] + t["decode_s"]
        rows.append({"codec": codec.describe(), "encode_us": 1e6 * t["encode_s"], "decode_us": 1e6 * t["decode_s"],
                     "GB_s": moved / seconds / 1e9, "of_copy_bandwidth": moved / seconds / bandwidth})
        print(rows[-1], flush=True)
    hook = hook_at_world_size_one(device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.machine()
    meta = {"device": name, "torch": torch.__version__, "numel": numel, "world_size": args.world_size,
            "copy_GB_s": bandwidth / 1e9, "compile": os.environ.get("NETGAIN_COMPILE", "auto"), "hook": hook}
    (args.out / "gpu_codecs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Codec throughput on the GPU", "", f"Device: {name}; torch {torch.__version__}; bucket {numel:,} fp32 "
             f"elements in 16 parameters; codes for n = {args.world_size}; copy bandwidth {bandwidth / 1e9:.0f} GB/s "
             f"(read + write, same run). Hook at world size 1 on {device}: {hook}.", "",
             "| codec | encode us | decode us | GB/s moved | of copy bandwidth |", "|---|---|---|---|---|"]
    lines += [f"| {r['codec']} | {r['encode_us']:.0f} | {r['decode_us']:.0f} | {r['GB_s']:.0f} | "
              f"{r['of_copy_bandwidth']:.2f} |" for r in rows]
    (args.out / "gpu_codecs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
