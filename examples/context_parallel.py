"""Context-parallel decode and verify with attn_dispatch under torch.distributed (gloo).

Every rank holds part of every request's KV tokens: vLLM's interleaved decode-context-parallel
layout (token t on rank ``(t // interleave) % world``) or a contiguous split. Each rank runs
``attention(..., return_lse=True)`` over its own tokens through its own binding, then
``merge_ranks`` all-gathers the attention states and merges them by LSE: the result is
attention over every key. Rank 0 checks it against one process that sees the whole cache.

Run it on this machine (two processes, gloo, 127.0.0.1 only)::

    python examples/context_parallel.py                  # launches 2 ranks itself
    python examples/context_parallel.py --world-size 3 --layout contiguous

Under torchrun the same file is the per-rank program::

    torchrun --nproc-per-node=2 examples/context_parallel.py

It prints one line per (backend, kind, phase) on rank 0 with the max abs error against the
single-process result, and exits 0 when every error is within tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import socket
import subprocess
import sys
from typing import Any


def make_case(kind: str, phase_name: str, seed: int = 3) -> dict[str, Any]:
    """One global batch: random q and a paged cache with shuffled pages (same on every rank)."""
    import torch

    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch import tree_mask

    g = torch.Generator().manual_seed(seed)
    phase = Phase[phase_name]
    ps, heads = 8, 8
    q_lens = [1, 1, 1, 1] if phase is Phase.DECODE else [4, 2, 3, 1]
    kv_lens = [37, 5, 64, 18] if phase is Phase.DECODE else [41, 9, 66, 20]
    need = [math.ceil(k / ps) for k in kv_lens]
    perm = torch.randperm(sum(need) + 4, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    masks = None
    if phase is Phase.VERIFY:
        trees = [[-1, 0, 0, 1], [-1, 0], [-1, 0, 1], [-1]]
        masks = [tree_mask(t, k - len(t)) for t, k in zip(trees, kv_lens, strict=True)]
    if kind == "mla":
        config = AttnConfig(
            kind="mla",
            num_q_heads=heads,
            num_kv_heads=1,
            head_dim=48,
            v_head_dim=32,
            dtype="float32",
            page_size=ps,
            tree_verify=masks is not None,
            return_lse=True,
        )
        k = torch.randn(len(perm), ps, 48, generator=g)
        v = None
    else:
        config = AttnConfig(
            kind="mha",
            num_q_heads=heads,
            num_kv_heads=2,
            head_dim=32,
            dtype="float32",
            page_size=ps,
            tree_verify=masks is not None,
            return_lse=True,
        )
        k = torch.randn(len(perm), ps, 2, 32, generator=g)
        v = torch.randn(len(perm), ps, 2, 32, generator=g)
    q = torch.randn(sum(q_lens), heads, config.head_dim, generator=g)
    batch = AttnBatch.build(
        phase,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=ps,
        num_pages=len(perm),
        masks=masks,
    )
    return {
        "config": config,
        "batch": batch,
        "q": q,
        "k": k,
        "v": v,
        "masks": masks,
        "sm_scale": 1.0 / math.sqrt(config.head_dim),
    }


def rank_part(
    backend: str, case: dict[str, Any], rank: int, world: int, layout: str, interleave: int
) -> tuple[Any, Any]:
    """This rank's attention state over its own tokens, over every global query row."""
    from attn_dispatch import BackendSpec
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch.distributed import expand_state
    from attn_dispatch.distributed import shard_for_rank

    binding = bind(BackendSpec.uniform(backend), case["config"], label=f"cp-rank{rank}")
    shard = shard_for_rank(
        case["batch"],
        case["k"],
        case["v"],
        rank=rank,
        world=world,
        layout=layout,
        interleave=interleave,
        masks=case["masks"],
    )
    out = lse = None
    if shard.batch is not None:
        with attn_scope(binding, shard.batch):
            out, lse = attention(
                case["q"][shard.rows],
                shard.k_cache,
                shard.v_cache,
                sm_scale=case["sm_scale"],
                return_lse=True,
            )
    return expand_state(out, lse, shard, like=case["q"], v_head_dim=int(case["config"].v_head_dim))


def whole(backend: str, case: dict[str, Any]) -> Any:
    """Attention over the whole cache in one process (what the ranks must reproduce)."""
    from attn_dispatch import BackendSpec
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind

    config = dataclasses.replace(case["config"], tree_verify=case["masks"] is not None)
    binding = bind(BackendSpec.uniform(backend), config, label="whole")
    with attn_scope(binding, case["batch"]):
        return attention(
            case["q"], case["k"], case["v"], sm_scale=case["sm_scale"], return_lse=True
        )


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from attn_dispatch.distributed import merge_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    backends = ["torch"] if args.quick else ["torch", "native"]
    for backend in backends:
        for kind in ("mha", "mla"):
            for phase in ("DECODE", "VERIFY"):
                case = make_case(kind, phase)
                out, lse = rank_part(backend, case, rank, world, args.layout, args.interleave)
                merged, merged_lse = merge_ranks(out, lse)
                if rank == 0:
                    ref, ref_lse = whole(backend, case)
                    err = float((merged - ref).abs().max())
                    lerr = float((merged_lse - ref_lse).abs().max())
                    ok = err < 1e-4 and lerr < 1e-4
                    failed += not ok
                    print(
                        f"{backend:7s} {kind} {phase:6s} world={world} {args.layout}: "
                        f"max abs error out {err:.2e} lse {lerr:.2e} "
                        f"{'ok' if ok else 'FAIL'}",
                        flush=True,
                    )
    dist.destroy_process_group()
    return 1 if failed else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> int:
    port = free_port()
    procs = []
    for rank in range(args.world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(args.world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    codes = [p.wait(timeout=args.timeout + 60) for p in procs]
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layout", choices=["interleaved", "contiguous"], default="interleaved")
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="the torch backend only")
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
