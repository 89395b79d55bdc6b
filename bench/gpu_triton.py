"""Decode bandwidth of the triton backend on one CUDA device, next to the device's peak.

    python bench/gpu_triton.py            # CUDA: MLA 576/512 and GQA 32/8x128, bf16,
                                          # batch 64, context 4096, page size 64
    python bench/gpu_triton.py --dry-run  # CPU: same code path under TRITON_INTERPRET=1,
                                          # tiny shapes, numbers meaningless
    python bench/gpu_triton.py --quick    # those tiny shapes, on CUDA when there is one

Decode is memory bound, so the figure is (K/V bytes the kernel must read) / (kernel time):
MLA reads 576 x 2 bytes per token, GQA 2 x 8 x 128 x 2 bytes per token (q and output are
<1% of it and not counted). Each row also checks two requests against a plain fp32 reference
so a fast wrong kernel cannot print a good number.

Then the layer-variant rows, each measured side by side in this run: GQA decode at context
8192 with a 1024-key sliding window (window_left=1023) against full attention (the window
reads 1/8 of the keys: the kernels start each request's split range at its window), and FP8
(float8_e4m3fn and float8_e5m2) caches against bf16 for both cases (half the KV bytes).
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
    ap.add_argument("--window-context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024, help="keys per window (window_left + 1)")
    ap.add_argument("--no-variants", action="store_true", help="skip the window and FP8 rows")
    ap.add_argument(
        "--quick", action="store_true", help="the --dry-run sizes, no variant rows (CUDA if any)"
    )
    args = ap.parse_args()
    if args.quick:  # a smoke run: the dry run's tiny shapes, on the GPU when there is one
        import torch

        args.dry_run = not torch.cuda.is_available()
        args.batch, args.context, args.page_size, args.iters = 2, 96, 16, 1
        args.window_context, args.window, args.no_variants = 160, 32, True
    if args.dry_run:
        # Must be set before the kernels are defined (first import of the backend module).
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.context, args.page_size, args.iters = 2, 96, 16, 1
        args.window_context, args.window = 160, 32

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
    if not args.no_variants:
        failed |= variant_rows(torch, args, device, on_cuda, peak)
    if not on_cuda:
        print("dry run: logic exercised on CPU; the times are interpreter times, not GPU figures")
    return 1 if failed else 0


def timed(torch, run, call_args, kwargs, on_cuda, iters):  # type: ignore[no-untyped-def]
    """Seconds per call: CUDA events over ``iters`` calls, or one interpreter call."""
    if not on_cuda:
        t0 = time.perf_counter()
        run(*call_args, **kwargs)
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        run(*call_args, **kwargs)
    start.record()
    for _ in range(iters):
        run(*call_args, **kwargs)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / iters


def variant_rows(torch, args, device, on_cuda, peak):  # type: ignore[no-untyped-def]
    """Window vs full decode (GQA, long context) and FP8 vs bf16 decode, side by side."""
    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch.backends.triton.backend import TritonBackend

    failed = False
    tag = "" if on_cuda else " [dry run, interpreter]"

    def make_batch(b, ctx, ps):  # type: ignore[no-untyped-def]
        pages_per = math.ceil(ctx / ps)
        gen = torch.Generator().manual_seed(1)
        kv_indices = torch.randperm(b * pages_per, generator=gen).to(torch.int32).to(device)
        batch = AttnBatch(
            Phase.DECODE,
            torch.arange(b + 1, dtype=torch.int32).to(device),
            (torch.arange(b + 1, dtype=torch.int32) * pages_per).to(device),
            kv_indices,
            torch.full((b,), ctx, dtype=torch.int32).to(device),
            page_size=ps,
        )
        return batch, kv_indices, pages_per

    def one(case, batch, kv_indices, pages_per, ctx, kv_dtype, window, k_bf16, v_bf16, q):  # type: ignore[no-untyped-def]
        ps = args.page_size
        cfg = AttnConfig(
            case.kind, case.hq, case.hkv, case.d, case.dv, dtype="bfloat16",
            kv_dtype=kv_dtype, page_size=ps, device=device,
            window_left=None if window is None else window - 1,
        )  # fmt: skip
        backend = TritonBackend(cfg)
        kwargs = {}
        k, v, ks, vs = k_bf16, v_bf16, 1.0, 1.0
        if kv_dtype != "bfloat16":
            # Per-tensor scales as a serving stack computes them: amax / format max.
            fmax = torch.finfo(getattr(torch, kv_dtype)).max
            ks = float(k_bf16.abs().amax()) / fmax
            k = (k_bf16.float() / ks).to(getattr(torch, kv_dtype))
            kwargs["k_scale"] = ks
            if v_bf16 is not None:
                vs = float(v_bf16.abs().amax()) / fmax
                v = (v_bf16.float() / vs).to(getattr(torch, kv_dtype))
                kwargs["v_scale"] = vs
        run = backend.handler(Phase.DECODE)
        plan = backend.plan(batch)
        scale = 1.0 / math.sqrt(case.d)
        out = run(q, k, v, plan, scale, **kwargs)
        # Against the bf16 cache: the FP8 rounding shows in the error column.
        err = check(torch, out, q, k_bf16, v_bf16, kv_indices, pages_per, ps, ctx, scale, case,
                    window=window)  # fmt: skip
        secs = timed(torch, run, (q, k, v, plan, scale), kwargs, on_cuda, args.iters)
        return secs, err, plan.num_splits

    def elem_bytes(kv_dtype):  # type: ignore[no-untyped-def]
        return 2 if kv_dtype == "bfloat16" else 1

    def token_bytes(case, kv_dtype):  # type: ignore[no-untyped-def]
        per = case.d if case.kind == "mla" else 2 * case.hkv * case.d
        return per * elem_bytes(kv_dtype)

    def caches(case, num_pages, ps):  # type: ignore[no-untyped-def]
        bf = torch.bfloat16
        if case.kind == "mla":
            return torch.randn(num_pages, ps, case.d, device=device, dtype=bf), None
        shape = (num_pages, ps, case.hkv, case.d)
        return (
            torch.randn(shape, device=device, dtype=bf),
            torch.randn(shape, device=device, dtype=bf),
        )

    b, ps = args.batch, args.page_size
    # -- window vs full at a long context (GQA) --
    ctx, w = args.window_context, args.window
    case = CASES[1]
    batch, kv_indices, pages_per = make_batch(b, ctx, ps)
    k, v = caches(case, b * pages_per, ps)
    q = torch.randn(b, case.hq, case.d, device=device, dtype=torch.bfloat16)
    print()
    print(f"sliding window, {case.name}, batch {b}, context {ctx}, page {ps}, bf16 decode")
    print(f"{'row':<28} {'splits':>6} {'us/call':>10} {'keys read':>10} {'GB/s':>8} {'max err':>8}")
    rows = {}
    for label, window in (("full", None), (f"window {w}", w)):
        secs, err, splits = one(
            case, batch, kv_indices, pages_per, ctx, "bfloat16", window, k, v, q
        )
        keys = ctx if window is None else min(ctx, window)
        gbs = b * keys * token_bytes(case, "bfloat16") / secs / 1e9
        failed |= err > 3e-2
        rows[label] = secs
        print(f"{label:<28} {splits:>6} {secs * 1e6:>10.1f} {keys:>10} {gbs:>8.0f} {err:>8.1e}")
    ratio = rows[f"window {w}"] / rows["full"]
    print(f"window / full time: {ratio:.2f}x (keys {min(ctx, w) / ctx:.3f}x)")
    print(
        f"SUMMARY triton decode {case.name} ctx {ctx}: window {w} {rows[f'window {w}'] * 1e6:.1f} "
        f"us vs full {rows['full'] * 1e6:.1f} us = {ratio:.2f}x{tag}"
    )
    del k, v

    # -- FP8 vs bf16 at the main context (both cases) --
    ctx = args.context
    batch, kv_indices, pages_per = make_batch(b, ctx, ps)
    print()
    print(f"FP8 KV cache vs bf16, batch {b}, context {ctx}, page {ps}, decode (bf16 q and out)")
    print(f"{'row':<40} {'us/call':>10} {'GB/s':>8} {'of peak':>8} {'vs bf16':>8} {'max err':>8}")
    for case in CASES:
        k, v = caches(case, b * pages_per, ps)
        q = torch.randn(b, case.hq, case.d, device=device, dtype=torch.bfloat16)
        base = None
        for kv_dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            try:
                secs, err, _ = one(case, batch, kv_indices, pages_per, ctx, kv_dtype, None, k, v, q)
            except Exception as exc:  # e.g. e4m3fn below sm89: report and go on
                print(f"{case.name + ' ' + kv_dtype:<40} not run: {type(exc).__name__}: {exc}")
                continue
            # FP8 error is the format's rounding (3 or 2 mantissa bits), not a kernel fault
            failed |= err > (3e-2 if kv_dtype == "bfloat16" else 0.25)
            base = secs if kv_dtype == "bfloat16" else base
            gbs = b * ctx * token_bytes(case, kv_dtype) / secs / 1e9
            of_peak = f"{gbs / peak:.0%}" if peak else "n/a"
            rel = f"{secs / base:.2f}x" if base else "n/a"
            print(
                f"{case.name + ' ' + kv_dtype:<40} {secs * 1e6:>10.1f} {gbs:>8.0f} {of_peak:>8} "
                f"{rel:>8} {err:>8.1e}"
            )
            if kv_dtype != "bfloat16":
                print(
                    f"SUMMARY triton decode {case.name} {kv_dtype} vs bf16, batch {b} x {ctx}: "
                    f"{secs * 1e6:.1f} us = {rel} of bf16, {gbs:.0f} GB/s, max err {err:.1e}{tag}"
                )
        del k, v
    return failed


def check(torch, out, q, k, v, kv_indices, pages_per, ps, ctx, scale, case, window=None):  # type: ignore[no-untyped-def]
    """Max abs error of requests 0 and 1 against dense fp32 attention (over the last
    ``window`` keys when given)."""
    worst = 0.0
    first = 0 if window is None else max(0, ctx - window)
    pos = torch.arange(first, ctx, device=q.device)
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
