"""Decode bandwidth of the triton backend on one CUDA device, next to the device's peak.

    python bench/gpu_triton.py            # CUDA: MLA 576/512 and GQA 32/8x128, bf16,
                                          # batch 64, context 4096, page size 64
    python bench/gpu_triton.py --dry-run  # CPU: same code path under TRITON_INTERPRET=1,
                                          # tiny shapes, numbers meaningless

Decode is memory bound, so the figure is (K/V bytes the kernel must read) / (kernel time):
MLA reads 576 x 2 bytes per token, GQA 2 x 8 x 128 x 2 bytes per token (q and output are
<1% of it and not counted). Each row also checks two requests against a plain fp32 reference
so a fast wrong kernel cannot print a good number.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

# Peak memory bandwidth in GB/s by device name, used when torch does not expose the memory
# clock and bus width. Vendor datasheet figures.
PEAK_GBS = {
    "H200": 4800.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    hq: int
    hkv: int
    d: int
    dv: int


CASES = (
    Case("MLA 576/512 x16 heads", "mla", 16, 1, 576, 512),
    Case("GQA 32/8 x128", "mha", 32, 8, 128, 128),
)


def peak_gbs(torch: object, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-gbs"
    props = torch.cuda.get_device_properties(0)  # type: ignore[attr-defined]
    clock = getattr(props, "memory_clock_rate", 0)  # kHz
    bus = getattr(props, "memory_bus_width", 0)  # bits
    if clock and bus:
        return 2.0 * clock * 1e3 * bus / 8 / 1e9, "memory clock x bus width (DDR)"
    for key, value in PEAK_GBS.items():
        if key in props.name:
            return value, f"datasheet ({key})"
    return None, "unknown device: pass --peak-gbs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=None, help="override the device peak")
    args = ap.parse_args()
    if args.dry_run:
        # Must be set before the kernels are defined (first import of the backend module).
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.context, args.page_size, args.iters = 2, 96, 16, 1

    import torch

    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch.backends.triton.backend import TritonBackend

    on_cuda = torch.cuda.is_available() and not args.dry_run
    if not on_cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run to exercise the script on CPU")
        return 2
    device = "cuda" if on_cuda else "cpu"
    peak, source = peak_gbs(torch, args.peak_gbs) if on_cuda else (None, "dry run")
    label = torch.cuda.get_device_name(0) if on_cuda else "CPU (TRITON_INTERPRET=1)"
    print(f"device: {label}; peak {peak or float('nan'):.0f} GB/s ({source})")
    print(f"batch {args.batch}, context {args.context}, page size {args.page_size}, bf16 decode")
    print(f"{'case':<24} {'splits':>6} {'us/call':>10} {'GB/s':>9} {'of peak':>8} {'max err':>8}")

    b, ctx, ps = args.batch, args.context, args.page_size
    pages_per = math.ceil(ctx / ps)
    num_pages = b * pages_per
    gen = torch.Generator().manual_seed(0)
    # Scattered pages, as a serving cache has them after a while.
    kv_indices = torch.randperm(num_pages, generator=gen).to(torch.int32).to(device)
    kv_indptr = (torch.arange(b + 1, dtype=torch.int32) * pages_per).to(device)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32).to(device)
    kv_lens = torch.full((b,), ctx, dtype=torch.int32).to(device)
    batch = AttnBatch(Phase.DECODE, qo_indptr, kv_indptr, kv_indices, kv_lens, page_size=ps)

    failed = False
    for case in CASES:
        cfg = AttnConfig(
            case.kind,  # type: ignore[arg-type]
            case.hq,
            case.hkv,
            case.d,
            case.dv,
            dtype="bfloat16",
            page_size=ps,
            device=device,
        )
        backend = TritonBackend(cfg)
        q = torch.randn(b, case.hq, case.d, device=device, dtype=torch.bfloat16)
        if case.kind == "mla":
            k = torch.randn(num_pages, ps, case.d, device=device, dtype=torch.bfloat16)
            v = None
            token_bytes = case.d * 2
        else:
            shape = (num_pages, ps, case.hkv, case.d)
            k = torch.randn(shape, device=device, dtype=torch.bfloat16)
            v = torch.randn(shape, device=device, dtype=torch.bfloat16)
            token_bytes = 2 * case.hkv * case.d * 2
        scale = 1.0 / math.sqrt(case.d)
        run = backend.handler(Phase.DECODE)
        plan = backend.plan(batch)
        out = run(q, k, v, plan, scale)  # compiles
        err = check(torch, out, q, k, v, kv_indices, pages_per, ps, ctx, scale, case)
        failed |= err > 3e-2
        if on_cuda:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                run(q, k, v, plan, scale)
            start.record()
            for _ in range(args.iters):
                run(q, k, v, plan, scale)
            stop.record()
            torch.cuda.synchronize()
            secs = start.elapsed_time(stop) / 1e3 / args.iters
        else:
            # Interpreter wall time: exercises the arithmetic below, says nothing about GPUs.
            t0 = time.perf_counter()
            run(q, k, v, plan, scale)
            secs = time.perf_counter() - t0
        gbs = b * ctx * token_bytes / secs / 1e9
        ratio = f"{gbs / peak:.0%}" if peak else "n/a"
        print(
            f"{case.name:<24} {plan.num_splits:>6} {secs * 1e6:>10.1f} {gbs:>9.0f} {ratio:>8} "
            f"{err:>8.1e}"
        )
        # One line per case for bench/gpu.sh's summary table.
        where = f"of {peak:.0f} GB/s peak" if peak else "(peak unknown)"
        tag = "" if on_cuda else " [dry run, interpreter]"
        print(
            f"SUMMARY triton decode {case.name}, batch {b} x {ctx}, page {ps}: {gbs:.0f} GB/s "
            f"= {ratio} {where}; {plan.num_splits} splits, max err {err:.1e}{tag}"
        )
    if not on_cuda:
        print("dry run: logic exercised on CPU; the times are interpreter times, not GPU figures")
    return 1 if failed else 0


def check(torch, out, q, k, v, kv_indices, pages_per, ps, ctx, scale, case):  # type: ignore[no-untyped-def]
    """Max abs error of requests 0 and 1 against dense fp32 attention."""
    worst = 0.0
    pos = torch.arange(ctx, device=q.device)
    for i in range(min(2, q.shape[0])):
        pages = kv_indices[i * pages_per : (i + 1) * pages_per].long()
        page, slot = pages[pos // ps], pos % ps
        if case.kind == "mla":
            keys = k[page, slot].float()  # [ctx, D]
            vals = keys[:, : case.dv]
            s = q[i].float() @ keys.T * scale  # [H, ctx]
            ref = torch.softmax(s, -1) @ vals
        else:
            keys = k[page, slot].float()  # [ctx, Hkv, D]
            vals = v[page, slot].float()
            g = case.hq // case.hkv
            qh = q[i].float().view(case.hkv, g, case.d)
            s = torch.einsum("kgd,tkd->kgt", qh, keys) * scale
            ref = torch.einsum("kgt,tkd->kgd", torch.softmax(s, -1), vals).reshape(case.hq, -1)
        worst = max(worst, (out[i].float() - ref).abs().max().item())
    return worst


if __name__ == "__main__":
    sys.exit(main())
