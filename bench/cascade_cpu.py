"""Cascade (shared-prefix) decode on the native CPU kernels, measured side by side in one run.

    python bench/cascade_cpu.py [--batch 16] [--shared 3584] [--own 512] [--threads N]
    python bench/cascade_cpu.py --quick   # smoke run (tiny sizes, no roofline)

Decode, GQA 32/8 x 128, bf16, page 64 by default. Rows (times are medians of interleaved
repeats, so machine noise hits every column alike):

- shared tables, cascade on: every request's table starts with the same prefix pages;
- private copies: each request holds its own copy of the prefix pages (same values);
- shared tables, ``cascade=False``: the same tables read per request;
- nothing shared: private tables planned with cascade on and off (the planner finds nothing).

Also the plan cost at this batch (cascade found vs nothing to find; the whole ``plan`` and
the C++ planner alone, which the cascade search is part of), the roofline of the same
run (read bandwidth of one large tensor; fp32 GEMM throughput of torch.matmul), and the ISA
path the native kernels ran. Outputs of all layouts are compared (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernels_cpu import read_bandwidth
from kernels_cpu import time_side_by_side as median_times

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch._snapshot import BatchSnapshot
from attn_dispatch.backends.native._lib import NaError
from attn_dispatch.backends.native._lib import NaPlanArgs
from attn_dispatch.backends.native._lib import NaPlanInfo
from attn_dispatch.backends.native.backend import NativeBackend


def roofline() -> tuple[float, float]:
    """(read GB/s of a 1 GiB tensor, fp32 GEMM GFMA/s of a 1024^3 matmul) on this run's threads:
    the kernels are fp32 arithmetic on AVX2, so fp32 GEMM is their compute roof."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t = median_times({"gemm": lambda: a @ b}, 7)
    return read_bandwidth(5), 1024**3 / t["gemm"] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--shared", type=int, default=3584, help="shared prefix tokens (whole pages)")
    ap.add_argument("--own", type=int, default=512, help="each request's own tokens")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no roofline")
    args = ap.parse_args()
    if args.quick:  # figures from a quick run are not comparable: it only checks the script
        args.batch, args.shared, args.own, args.page_size, args.repeats = 2, 64, 16, 16, 1
        args.heads, args.head_dim = (4, 2), 32
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, ps, (Hq, Hkv), D = args.batch, args.page_size, args.heads, args.head_dim
    if args.shared % ps:
        raise SystemExit(f"--shared must be a multiple of the page size {ps}")
    n_shared, n_own = args.shared // ps, -(-args.own // ps)
    kv_len = args.shared + args.own
    cfg = AttnConfig("mha", Hq, Hkv, D, dtype="bfloat16", page_size=ps)
    # Pages: the shared prefix, each request's own pages, then each request's private copy of
    # the prefix (same values as the shared pages).
    own0 = n_shared
    copy0 = own0 + B * n_own
    num_pages = copy0 + B * n_shared
    k = torch.randn(num_pages, ps, Hkv, D, dtype=torch.bfloat16)
    v = torch.randn(num_pages, ps, Hkv, D, dtype=torch.bfloat16)
    for i in range(B):
        k[copy0 + i * n_shared : copy0 + (i + 1) * n_shared] = k[:n_shared]
        v[copy0 + i * n_shared : copy0 + (i + 1) * n_shared] = v[:n_shared]
    own = [list(range(own0 + i * n_own, own0 + (i + 1) * n_own)) for i in range(B)]
    shared_tables = [list(range(n_shared)) + own[i] for i in range(B)]
    private_tables = [
        list(range(copy0 + i * n_shared, copy0 + (i + 1) * n_shared)) + own[i] for i in range(B)
    ]

    def batch(tables: list[list[int]]) -> AttnBatch:
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1] * B, kv_lens=[kv_len] * B, page_tables=tables,
            page_size=ps, num_pages=num_pages,
        )  # fmt: skip

    on = NativeBackend(cfg, num_threads=args.threads)
    off = NativeBackend(cfg, num_threads=args.threads, cascade=False)
    shared_b, private_b = batch(shared_tables), batch(private_tables)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    s = D**-0.5
    run_on, run_off = on.handler(Phase.DECODE), off.handler(Phase.DECODE)
    plans = {
        "shared, cascade": (run_on, on.plan(shared_b)),
        "private copies": (run_on, on.plan(private_b)),
        "shared, cascade=False": (run_off, off.plan(shared_b)),
        "nothing shared, cascade=False": (run_off, off.plan(private_b)),
    }
    assert plans["shared, cascade"][1].cascade_groups == 1
    assert plans["private copies"][1].cascade_groups == 0
    outs = {name: fn(q, k, v, plan, s) for name, (fn, plan) in plans.items()}
    ref = outs["private copies"].float()
    worst = max((o.float() - ref).abs().max().item() for o in outs.values())
    times = median_times(
        {
            name: (lambda fn=fn, plan=plan: fn(q, k, v, plan, s))
            for name, (fn, plan) in plans.items()
        },
        args.repeats,
    )
    plan_t = median_times(
        {
            "plan, cascade found": lambda: on.plan(shared_b),
            "plan, nothing shared": lambda: on.plan(private_b),
            "plan, cascade=False": lambda: off.plan(shared_b),
        },
        args.repeats if args.quick else max(25, args.repeats),
    )
    # The C++ planner alone (the cascade search is part of it), without the Python snapshot.
    c_plan = {}
    for label, be, b in (
        ("na_plan_create, cascade found", on, shared_b),
        ("na_plan_create, nothing shared", on, private_b),
        ("na_plan_create, cascade=False", off, shared_b),
    ):
        snap = BatchSnapshot.of(b, ps)
        args_c = NaPlanArgs(
            num_requests=snap.num_requests, decode=1, split_target=max(32, 4 * be.threads()),
            qo_indptr=snap.qo_indptr.data_ptr(), kv_indptr=snap.kv_indptr.data_ptr(),
            kv_indices=snap.kv_indices.data_ptr(), num_indices=snap.kv_indices.numel(),
            kv_lens=snap.kv_lens.data_ptr(), mask=None, mask_len=0,
        )  # fmt: skip

        def create_free(
            be: NativeBackend = be, args_c: NaPlanArgs = args_c, snap: BatchSnapshot = snap
        ) -> None:
            # One plan made and freed in the library's own table (ABI 7); ``snap`` keeps the
            # index tensors that args_c points at alive.
            err, info, plan_id = NaError(), NaPlanInfo(), ctypes.c_uint64(0)
            rc = be._create(
                be._runner, ctypes.byref(args_c), ctypes.byref(plan_id), ctypes.byref(info),
                ctypes.byref(err),
            )  # fmt: skip
            assert rc == 0, rc
            be._free(be._runner, plan_id.value)

        c_plan[label] = create_free
    plan_t.update(median_times(c_plan, 3 if args.quick else 201))
    bw, gemm = (math.nan, math.nan) if args.quick else roofline()
    flops = B * kv_len * Hq * D * 2  # multiply-adds: q.k and p.v
    base = times["private copies"]
    print(
        f"native cascade decode: ISA path {on.library.isa}, {args.threads} threads, batch {B}, "
        f"GQA {Hq}/{Hkv} x {D} bf16, page {ps}, {args.shared} shared + {args.own} own tokens"
    )
    print(f"roofline (same run): read {bw:.1f} GB/s, fp32 GEMM {gemm:.1f} GFMA/s")
    print(f"{'layout':32} {'ms':>8} {'vs private':>11} {'GFMA/s':>8} {'of GEMM':>8}")
    for name, t in times.items():
        rate = flops / t / 1e9
        print(f"{name:32} {t * 1e3:8.2f} {base / t:10.2f}x {rate:8.1f} {rate / gemm:7.0%}")
    print(
        f"nothing shared: cascade on / off time = "
        f"{times['private copies'] / times['nothing shared, cascade=False']:.3f}"
    )
    for name, t in plan_t.items():
        print(f"{name:32} {t * 1e6:8.1f} us")
    print(f"largest difference between layouts: {worst:.3g} (bf16 outputs)")


if __name__ == "__main__":
    main()
