"""Decode bandwidth of the FlashInfer backend against the GPU's peak, side by side.

    python bench/gpu_flashinfer.py            # needs CUDA and flashinfer-python 0.7.x
    python bench/gpu_flashinfer.py --quick    # smoke run (tiny batch and context)

For each case it times, in one run and on the same tensors:
  - ``attention()`` through attn_dispatch (bind + attn_scope + the FlashInfer handler),
  - the same FlashInfer wrapper called directly (what the adapter adds on top),
  - a device-to-device copy (the bandwidth this GPU reaches in practice),
and prints decode GB/s (KV bytes read per call / time) as ratios of the theoretical peak
(NVML clock x bus width) and of the measured copy bandwidth. Goal from the issue: MLA decode
at batch 64, context 4096, 16 heads, bf16 >= 0.80 of peak. It also checks the output once
against the torch reference backend. The first call of a case includes FlashInfer's JIT
build when no prebuilt kernels are installed; it is reported apart and not timed.

Variant rows: FP8 caches (k_scale / v_scale per call; MLA e4m3fn needs SM90) next to the bf16
rows, and GQA at context 8192 with a 1024-key window next to full attention (GB/s counts the
keys a request may see).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def _peak_gbps(device: torch.device) -> float | None:
    try:
        from flashinfer.utils import get_gpu_memory_bandwidth

        return float(get_gpu_memory_bandwidth(device))
    except Exception as exc:  # NVML missing or refused: report measured ratios only
        print(f"# theoretical peak unavailable ({type(exc).__name__}: {exc})")
        return None


def _copy_gbps(device: torch.device, iters: int) -> float:
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    return 2 * n / seconds / 1e9  # read + write


def _time(fn, iters: int) -> float:
    """Seconds per call, CUDA events around ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run_case(name: str, cfg, batch_size: int, ctx: int, iters: int, peak, copy) -> None:
    from attn_dispatch import AttnBatch
    from attn_dispatch import Phase
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind

    dev = torch.device(cfg.device)
    dt = getattr(torch, cfg.dtype)
    ps = cfg.page_size
    pages_per = math.ceil(ctx / ps)
    total_pages = batch_size * pages_per
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(total_pages, generator=gen).tolist()  # scattered pages
    tables = [perm[i * pages_per : (i + 1) * pages_per] for i in range(batch_size)]
    batch = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * batch_size,
        kv_lens=[ctx] * batch_size,
        page_tables=tables,
        page_size=ps,
        num_pages=total_pages,
        device=dev,
    )
    q = torch.randn(batch_size, cfg.num_q_heads, cfg.head_dim, device=dev, dtype=dt)
    kv_dt = getattr(torch, str(cfg.kv_dtype))
    fp8 = kv_dt != dt
    # FP8: the cache holds K / k_scale and V / v_scale (scales chosen so values use the range)
    extras = {"k_scale": 0.05} if fp8 else {}
    if cfg.kind == "mla":
        k_cache = torch.randn(total_pages, ps, cfg.head_dim, device=dev, dtype=dt)
        k_cache = (k_cache / 0.05).to(kv_dt) if fp8 else k_cache
        v_cache = None
        bytes_per_token = cfg.head_dim * k_cache.element_size()
    else:
        shape = (total_pages, ps, cfg.num_kv_heads)
        k_cache = torch.randn(*shape, cfg.head_dim, device=dev, dtype=dt)
        v_cache = torch.randn(*shape, cfg.v_head_dim, device=dev, dtype=dt)
        if fp8:
            k_cache, v_cache = (k_cache / 0.05).to(kv_dt), (v_cache / 0.05).to(kv_dt)
            extras["v_scale"] = 0.05
        width = cfg.head_dim + cfg.v_head_dim
        bytes_per_token = cfg.num_kv_heads * width * k_cache.element_size()
    scale = 1.0 / math.sqrt(192 if cfg.kind == "mla" else cfg.head_dim)
    keys = ctx if cfg.window_left is None else min(ctx, cfg.window_left + 1)
    kv_bytes = batch_size * keys * bytes_per_token

    t0 = time.perf_counter()
    binding = bind("flashinfer", cfg, label=name, options={"flashinfer": {"sm_scale": scale}})
    with attn_scope(binding, batch):
        out = attention(q, k_cache, v_cache, sm_scale=scale, **extras)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t_ours = _time(lambda: attention(q, k_cache, v_cache, sm_scale=scale, **extras), iters)
        # the same wrapper, planned for this batch, called directly: the adapter's overhead
        backend = binding.backend(Phase.DECODE)
        plan = backend.plan(batch)
        if cfg.kind == "mla" and fp8:
            ks = extras["k_scale"]
            raw = lambda: plan.wrapper.run(  # noqa: E731
                query=q, kv_cache=k_cache, ckv_scale=ks, kpe_scale=ks
            )
        elif cfg.kind == "mla":
            raw = lambda: plan.wrapper.run(query=q, kv_cache=k_cache)  # noqa: E731
        else:
            raw = lambda: plan.wrapper.run(  # noqa: E731
                q=q, paged_kv_cache=(k_cache, v_cache), **extras
            )
        t_raw = _time(raw, iters)
        t_plan = _time(lambda: backend.plan(batch), 5)

    ref_binding = bind("torch", cfg, label=f"{name}-ref")
    with attn_scope(ref_binding, batch):
        ref = attention(q, k_cache, v_cache, sm_scale=scale, **extras)
    err = (out.float() - ref.float()).abs().max().item()

    gbps = kv_bytes / t_ours / 1e9
    gbps_raw = kv_bytes / t_raw / 1e9
    print(
        f"{name:<34} {t_ours * 1e6:8.1f} us {gbps:8.0f} GB/s"
        f"  vs peak {gbps / peak if peak else float('nan'):5.2f}"
        f"  vs copy {gbps / copy:5.2f}"
        f"  adapter/raw {t_ours / t_raw:5.3f} (raw {gbps_raw:.0f} GB/s)"
        f"  plan {t_plan * 1e6:.0f} us  first call {first:.1f} s  max|err| {err:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny batch and context")
    args = p.parse_args(argv)
    if args.quick:  # checks the script runs; the figures are not comparable
        args.iters, args.batch, args.ctx = 2, 4, 256
    if not torch.cuda.is_available():
        print("gpu_flashinfer: needs CUDA (torch.cuda.is_available() is False); nothing to run")
        return 0
    from attn_dispatch import AttnConfig

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    try:
        import flashinfer

        print(f"# flashinfer {flashinfer.__version__}")
    except ImportError:
        print("gpu_flashinfer: flashinfer-python is not installed")
        return 0
    peak = _peak_gbps(dev)
    copy = _copy_gbps(dev, 20)
    print(
        f"# peak {peak or float('nan'):.0f} GB/s (NVML), device copy {copy:.0f} GB/s "
        f"({copy / peak if peak else float('nan'):.2f} of peak)"
    )
    cases = [
        (
            "mla decode b64 ctx4096 h16 bf16",
            AttnConfig(
                kind="mla",
                num_q_heads=16,
                num_kv_heads=1,
                head_dim=576,
                v_head_dim=512,
                dtype="bfloat16",
                page_size=64,
                device="cuda",
            ),
        ),
        (
            "gqa decode b64 ctx4096 32/8x128 bf16",
            AttnConfig(
                kind="mha",
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=128,
                v_head_dim=128,
                dtype="bfloat16",
                page_size=16,
                device="cuda",
            ),
        ),
    ]
    mla_cfg, gqa_cfg = cases[0][1], cases[1][1]
    variant_cases = [
        ("mla decode b64 ctx4096 h16 fp8e4m3", mla_cfg.replace(kv_dtype="float8_e4m3fn"), args.ctx),
        ("gqa decode b64 ctx4096 fp8e4m3", gqa_cfg.replace(kv_dtype="float8_e4m3fn"), args.ctx),
        ("gqa decode b64 ctx4096 fp8e5m2", gqa_cfg.replace(kv_dtype="float8_e5m2"), args.ctx),
        ("gqa decode b64 ctx8192 full", gqa_cfg, 8192),
        ("gqa decode b64 ctx8192 window1024", gqa_cfg.replace(window_left=1023), 8192),
    ]
    for name, cfg, ctx in [(n, c, args.ctx) for n, c in cases] + variant_cases:
        try:
            run_case(name, cfg, args.batch, ctx, args.iters, peak, copy)
        except Exception as exc:  # one failing case must not hide the other's numbers
            print(f"{name:<34} FAILED: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
