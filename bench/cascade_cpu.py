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
run (read bandwidth of one large tensor; the GEMM peak: the faster of torch's fp32 and bf16
matmul, as in ``kernels_cpu.py``), and the ISA path the native kernels ran. Outputs of all
layouts are compared (bf16 tolerance).

Columns: ``GFMA/s`` multiply-adds of the layer (q.K^T and p.V) per second; ``of peak`` that
over the GEMM peak; ``roofline`` max(K/V bytes read once / read bandwidth, multiply-adds /
GEMM peak) over the time (shared pages count once where the table shares them).

The cascade floor below the table: a cascade call runs its shared part (every member's rows
over the shared keys: a many-query, compute-bound tile) and its own part (decode over each
member's own keys: bandwidth-bound) as items of one list, so its time is about the sum of the
two, each at best at its own roof: shared multiply-adds / GEMM peak + own K/V bytes / read
bandwidth. ``private / floor`` is the most any kernel could make the cascade faster than the
private copies as measured; ``for Nx`` is the share of that floor the call must reach for
``--target``x (3 by default, issue 42's target).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernels_cpu import gemm_peak
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


def roofline() -> tuple[float, float, str]:
    """(read GB/s of a 1 GiB tensor, GEMM peak GFMA/s, the dtype that reached it) on this
    run's threads: the faster of torch's fp32 and bf16 1024^3 matmul (the many-row kernels
    multiply in bf16 where the CPU has vdpbf16ps, the decode kernels in fp32)."""
    peak, dtype = gemm_peak(7)
    return read_bandwidth(5), peak / 1e9, dtype


def cascade_floor(
    batch: int, shared: int, own: int, heads: tuple[int, int], head_dim: int, bw: float, peak: float
) -> tuple[float, float]:
    """Seconds of a bf16 cascade call's two parts at their roofs: the shared part's
    multiply-adds (``batch`` members x ``shared`` keys x q heads x head_dim, q.K^T and p.V)
    at ``peak`` GFMA/s, and the own part's K/V bytes (``batch`` x ``own`` token rows of K and
    V over the kv heads) at ``bw`` GB/s."""
    hq, hkv = heads
    shared_s = batch * shared * hq * head_dim * 2 / (peak * 1e9)
    own_s = batch * own * hkv * head_dim * 2 * 2 / (bw * 1e9)
    return shared_s, own_s


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
    ap.add_argument(
        "--target", type=float, default=3.0, help="the speed-up over private copies to judge"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no roofline")
    args = ap.parse_args()
    if not args.target > 0:
        raise SystemExit(f"--target must be a speed-up above 0, got {args.target!r}")
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
    bw, gemm, gemm_dtype = (math.nan, math.nan, "n/a") if args.quick else roofline()
    flops = B * kv_len * Hq * D * 2  # multiply-adds: q.k and p.v
    row_bytes = Hkv * D * 2 * 2  # one token's K and V rows, bf16
    unique = (args.shared + B * args.own) * row_bytes  # shared pages read once
    kv_bytes = {
        "shared, cascade": unique,
        "private copies": B * kv_len * row_bytes,
        "shared, cascade=False": unique,
        "nothing shared, cascade=False": B * kv_len * row_bytes,
    }
    base = times["private copies"]
    print(
        f"native cascade decode: ISA path {on.library.isa}, {args.threads} threads, batch {B}, "
        f"GQA {Hq}/{Hkv} x {D} bf16, page {ps}, {args.shared} shared + {args.own} own tokens"
    )
    print(
        f"roofline (same run): read {bw:.1f} GB/s, GEMM peak {gemm:.1f} GFMA/s ({gemm_dtype}); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'layout':32} {'ms':>8} {'vs private':>11} {'GFMA/s':>8} {'of peak':>8} {'roofline':>9}"
    )
    for name, t in times.items():
        rate = flops / t / 1e9
        roof = max(kv_bytes[name] / (bw * 1e9), flops / (gemm * 1e9))
        print(
            f"{name:32} {t * 1e3:8.2f} {base / t:10.2f}x {rate:8.1f} {rate / gemm:7.0%} "
            f"{roof / t:8.0%}"
        )
    shared_s, own_s = cascade_floor(B, args.shared, args.own, (Hq, Hkv), D, bw, gemm)
    floor = shared_s + own_s
    cascade = times["shared, cascade"]
    need = base / args.target
    print(
        f"cascade floor: shared part {shared_s * 1e3:.2f} ms at the GEMM peak + own part "
        f"{own_s * 1e3:.2f} ms at the read bandwidth = {floor * 1e3:.2f} ms; the call reaches "
        f"{floor / cascade:.0%} of it; private / floor = {base / floor:.2f}x; for "
        f"{args.target:g}x: {need * 1e3:.2f} ms, {floor / need:.0%} of the floor"
    )
    print(
        f"nothing shared: cascade on / off time = "
        f"{times['private copies'] / times['nothing shared, cascade=False']:.3f}"
    )
    for name, t in plan_t.items():
        print(f"{name:32} {t * 1e6:8.1f} us")
    print(f"largest difference between layouts: {worst:.3g} (bf16 outputs)")


if __name__ == "__main__":
    main()
