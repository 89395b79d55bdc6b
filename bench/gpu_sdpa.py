"""The ``sdpa`` backend on CUDA: paged prefill, extend and decode against raw SDPA, contiguous K/V.

    python bench/gpu_sdpa.py              # on a CUDA machine (bench/gpu.sh runs it)
    python bench/gpu_sdpa.py --dry-run    # tiny shapes on the CPU: checks the script itself
    python bench/gpu_sdpa.py --quick      # 3 iterations (a dry run without CUDA)

GQA 32/8 x 128, bf16, page 64, shuffled pages. Per shape, one process, contenders alternating
(median of ``--iters`` timed with CUDA events after a warm-up):

- ``raw``: ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V laid out
  contiguous ``[B, H, L, D]`` (``enable_gqa=True``; bottom-right causal mask when there is a
  prefix), which is what a user without paged KV would call;
- ``sdpa``: the backend through ``bind`` / ``attn_scope`` / ``attention`` over the pages, the
  plan made once per forward of ``LAYERS`` layer calls (as in a model), per layer call.

Each row also gives the largest difference from raw SDPA (both bf16), so a wrong gather shows
as an error, not as a speed. The last lines are ``SUMMARY`` rows that bench/gpu.sh collects.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._table import format_table

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 64
LAYERS = 4
#: (name, phase, batch, context, new tokens per request)
SHAPES = [
    ("prefill 1024 B2", Phase.PREFILL, 2, 1024, 1024),
    ("extend 128+896 B2", Phase.PREFILL, 2, 1024, 128),
    ("decode B64 4k", Phase.DECODE, 64, 4096, 1),
]
DRY_SHAPES = [
    ("prefill 64 B2", Phase.PREFILL, 2, 64, 64),
    ("extend 16+48 B2", Phase.PREFILL, 2, 64, 16),
    ("decode B4 128", Phase.DECODE, 4, 128, 1),
]


def _case(
    phase: Phase, batch: int, ctx: int, q_len: int, device: str
) -> dict[str, torch.Tensor | AttnBatch]:
    g = torch.Generator().manual_seed(0)
    per = math.ceil(ctx / PAGE)
    total = per * batch + 3
    perm = torch.randperm(total, generator=g).tolist()
    tables = [perm[i * per : (i + 1) * per] for i in range(batch)]
    k_cache = torch.randn(total, PAGE, KV_HEADS, DIM, generator=g).bfloat16()
    v_cache = torch.randn(total, PAGE, KV_HEADS, DIM, generator=g).bfloat16()
    q = torch.randn(batch * q_len, HEADS, DIM, generator=g).bfloat16()
    k = torch.stack([k_cache[t].reshape(-1, KV_HEADS, DIM)[:ctx] for t in tables])
    v = torch.stack([v_cache[t].reshape(-1, KV_HEADS, DIM)[:ctx] for t in tables])
    paged = AttnBatch.build(
        phase,
        q_lens=[q_len] * batch,
        kv_lens=[ctx] * batch,
        page_tables=tables,
        page_size=PAGE,
        num_pages=total,
        device=device,
    )
    return {
        "q": q.to(device),
        "k_cache": k_cache.to(device),
        "v_cache": v_cache.to(device),
        "batch": paged,
        "qb": q.view(batch, q_len, HEADS, DIM).transpose(1, 2).to(device),
        "k": k.transpose(1, 2).contiguous().to(device),
        "v": v.transpose(1, 2).contiguous().to(device),
    }


def _raw(
    c: dict[str, torch.Tensor | AttnBatch], q_len: int, ctx: int
) -> Callable[[], torch.Tensor]:
    qb, k, v = c["qb"], c["k"], c["v"]
    assert isinstance(qb, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    scale = DIM**-0.5
    if q_len == ctx:
        return lambda: F.scaled_dot_product_attention(
            qb, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
    prefix = ctx - q_len
    mask = (
        torch.arange(q_len, device=qb.device)[:, None] + prefix
        >= torch.arange(ctx, device=qb.device)[None, :]
    )
    return lambda: F.scaled_dot_product_attention(
        qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )


def _backend(c: dict[str, torch.Tensor | AttnBatch], device: str) -> Callable[[], torch.Tensor]:
    cfg = AttnConfig("mha", HEADS, KV_HEADS, DIM, dtype="bfloat16", page_size=PAGE, device=device)
    binding = bind("sdpa", cfg)
    q, kc, vc, batch = c["q"], c["k_cache"], c["v_cache"], c["batch"]
    assert isinstance(batch, AttnBatch)

    def run() -> torch.Tensor:
        with attn_scope(binding, batch):
            for _ in range(LAYERS):
                out = attention(q, kc, vc, sm_scale=DIM**-0.5)
        return out

    return run


def _time(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call (CUDA events on CUDA, wall clock on the CPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 3 iterations; --dry-run without CUDA"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.iters = 3
        args.dry_run = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    iters = 3 if args.dry_run else args.iters
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"# sdpa backend vs raw SDPA, {where}, torch {torch.__version__}, median of {iters}")
    rows, summary = [], []
    for name, phase, batch, ctx, q_len in DRY_SHAPES if args.dry_run else SHAPES:
        c = _case(phase, batch, ctx, q_len, device)
        raw_fn, ours = _raw(c, q_len, ctx), _backend(c, device)
        raw_out = raw_fn().transpose(1, 2).reshape(batch * q_len, HEADS, DIM)
        err = (ours().float() - raw_out.float()).abs().max().item()
        times: dict[str, list[float]] = {"raw": [], "sdpa": []}
        for _ in range(2):
            raw_fn()
            ours()
        for _ in range(iters):
            times["raw"].append(sum(_time(raw_fn, device) for _ in range(LAYERS)) / LAYERS)
            times["sdpa"].append(_time(ours, device) / LAYERS)
        raw_ms = statistics.median(times["raw"]) * 1e3
        ours_ms = statistics.median(times["sdpa"]) * 1e3
        rows.append(
            [name, f"{raw_ms:.3f}", f"{ours_ms:.3f}", f"{ours_ms / raw_ms:.2f}", f"{err:.1e}"]
        )
        summary.append(
            f"SUMMARY sdpa {name} on {where}: {ours_ms:.3f} ms per layer call, "
            f"{ours_ms / raw_ms:.2f}x raw SDPA's time on contiguous K/V, max |diff| {err:.1e}"
        )
        if not err < 0.05:
            print(f"sdpa differs from raw SDPA on {name}: max |diff| {err}", file=sys.stderr)
            return 1
    print(format_table(["shape", "raw ms", "sdpa ms", "sdpa / raw", "max |diff|"], rows))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
