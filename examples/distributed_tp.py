"""Tensor-parallel attention with attn_dispatch under torch.distributed.

Each process holds a slice of the attention heads (``num_q_heads / world`` query heads and
``num_kv_heads / world`` KV heads), binds its runners for that slice from a pickled
``BackendSpec`` sent by rank 0, learns the plugin backend ``tpdemo`` through the entry-point
group ``attn_dispatch.backends`` (no code of its own registers it), runs its heads, and the
outputs are all-gathered along the head axis. Rank 0 checks the result against one process
that runs every head.

Run it on this machine (two processes, gloo, 127.0.0.1 only)::

    python examples/distributed_tp.py                 # launches 2 ranks itself
    python examples/distributed_tp.py --world-size 4

Under torchrun, the same file is the per-rank program (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT)::

    torchrun --nproc-per-node=2 examples/distributed_tp.py                    # CPU, gloo
    torchrun --nproc-per-node=8 examples/distributed_tp.py --device cuda      # 8 GPUs, nccl
    # two machines with 8 GPUs each: run on both, node-rank 0 and 1
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 examples/distributed_tp.py --device cuda

With ``--device cuda`` each rank uses ``cuda:LOCAL_RANK`` and binds its config with that
device. The plugin is installed in a temporary folder per process here (a ``.dist-info``
with ``entry_points.txt``); in a deployment it is ``pip install``-ed on every machine.

It prints one JSON line (``RESULT {...}``) on rank 0 and exits 0 when every runner's gathered
output equals the single-process output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENTRY_POINTS = "[attn_dispatch.backends]\ntpdemo = tp_plugin_backend:register\n"

# Full model shapes; every rank holds heads / world of them.
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 8, 4, 16, 4, 32
RUNNERS = {
    # The target prefills with the reference and decodes with the plugin; the draft is all plugin.
    "target": "prefill=torch,decode=tpdemo",
    "draft": "tpdemo",
}


def install_demo_plugin() -> Path:
    """Put a plugin distribution (a ``.dist-info`` with entry points) on ``sys.path``.

    Stands in for ``pip install`` of a package whose pyproject declares
    ``[project.entry-points."attn_dispatch.backends"] tpdemo = "tp_plugin_backend:register"``.
    Must run before attn_dispatch's registry is first used in this process.
    """
    root = Path(tempfile.mkdtemp(prefix="attn-tp-plugin-"))
    info = root / "attn_tpdemo_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: attn-tpdemo-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    shutil.copy(HERE / "tp_plugin_backend.py", root / "tp_plugin_backend.py")
    sys.path.insert(0, str(root))
    import importlib

    importlib.invalidate_caches()
    return root


def make_inputs(phase_name: str, device: str) -> dict[str, Any]:
    """The same full-size batch and tensors on every rank (seeded)."""
    import torch

    from attn_dispatch import AttnBatch
    from attn_dispatch import Phase

    phase = Phase[phase_name]
    g = torch.Generator().manual_seed(1234 + phase.value)
    if phase is Phase.DECODE:
        q_lens, kv_lens = [1, 1, 1], [9, 3, 14]
    else:
        q_lens, kv_lens = [4, 2], [4, 11]
    need = [-(-n // PAGE_SIZE) for n in kv_lens]
    perm = torch.randperm(NUM_PAGES, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    batch = AttnBatch.build(
        phase,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        device=device,
    )
    shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return {
        "batch": batch,
        "q": torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g).to(device),
        "k": torch.randn(*shape, generator=g).to(device),
        "v": torch.randn(*shape, generator=g).to(device),
    }


def config_for(heads: int, kv_heads: int, device: str) -> Any:
    from attn_dispatch import AttnConfig

    return AttnConfig(
        kind="mha",
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        dtype="float32",
        page_size=PAGE_SIZE,
        device=device,
    )


def run_attention(binding: Any, inputs: dict[str, Any], heads: slice, kv_heads: slice) -> Any:
    from attn_dispatch import attention
    from attn_dispatch import attn_scope

    q = inputs["q"][:, heads].contiguous()
    k = inputs["k"][:, :, kv_heads].contiguous()
    v = inputs["v"][:, :, kv_heads].contiguous()
    with attn_scope(binding, inputs["batch"]):
        return attention(q, k, v, sm_scale=HEAD_DIM**-0.5)


def rank_main(args: argparse.Namespace) -> int:
    """One rank: bind from the broadcast specs, run this rank's heads, gather, compare."""
    plugin_dir = install_demo_plugin()
    import torch
    import torch.distributed as dist

    from attn_dispatch import BackendSpec
    from attn_dispatch import bind
    from attn_dispatch import record_dispatch
    from attn_dispatch.backend import list_backends

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        if HEADS % world or KV_HEADS % world:
            raise SystemExit(f"world size {world} must divide {HEADS} and {KV_HEADS} heads")
        # Rank 0 owns the choice; the others receive it as pickled BackendSpec values.
        box: list[Any] = [None]
        if rank == 0:
            box[0] = pickle.dumps({n: BackendSpec.parse(s) for n, s in RUNNERS.items()})
        dist.broadcast_object_list(box, src=0)
        specs: dict[str, BackendSpec] = pickle.loads(box[0])

        hq, hkv = HEADS // world, KV_HEADS // world
        mine = (slice(rank * hq, (rank + 1) * hq), slice(rank * hkv, (rank + 1) * hkv))
        shard_cfg = config_for(hq, hkv, device)
        report: dict[str, Any] = {"world_size": world, "backend": backend, "runners": {}}
        registered = sorted(list_backends())
        with record_dispatch() as rec:
            for name, spec in specs.items():
                binding = bind(spec, shard_cfg, label=f"{name}@rank{rank}")
                for phase in ("PREFILL", "DECODE"):
                    inputs = make_inputs(phase, device)
                    part = run_attention(binding, inputs, *mine)
                    parts = [torch.empty_like(part) for _ in range(world)]
                    dist.all_gather(parts, part)
                    gathered = torch.cat(parts, dim=1)
                    if rank == 0:
                        full = bind(spec, config_for(HEADS, KV_HEADS, device), label=name)
                        single = run_attention(full, inputs, slice(None), slice(None))
                        diff = float((gathered - single).abs().max())
                        ref = bind("torch", config_for(HEADS, KV_HEADS, device))
                        reference = run_attention(ref, inputs, slice(None), slice(None))
                        report["runners"][f"{name}/{phase.lower()}"] = {
                            "spec": str(spec),
                            "backend": spec.backend_for(inputs["batch"].phase),
                            "shape": list(gathered.shape),
                            "max_abs_diff": diff,
                            "equal": bool(torch.allclose(gathered, single, atol=1e-5, rtol=1e-5)),
                            "matches_reference": bool(
                                torch.allclose(gathered, reference, atol=1e-4, rtol=1e-4)
                            ),
                        }
        counts = sorted(
            f"{label}:{phase}:{be}={n}"
            for (label, phase, be), n in rec.counts().items()
            if label is not None and "@rank" in label
        )
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, {"rank": rank, "registered": registered, "calls": counts})
        if rank == 0:
            report["ranks"] = everyone
            ok = all(r["equal"] and r["matches_reference"] for r in report["runners"].values())
            ok = ok and all("tpdemo" in r["registered"] for r in everyone)
            report["ok"] = ok
            print("RESULT " + json.dumps(report, sort_keys=True), flush=True)
            return 0 if ok else 1
        return 0
    finally:
        dist.destroy_process_group()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> int:
    """Start ``world_size`` ranks of this file on 127.0.0.1, as torchrun would."""
    port = free_port()
    procs = []
    for rank in range(args.world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world_size),
            LOCAL_WORLD_SIZE=str(args.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            # One thread per rank: the ranks share this machine's cores.
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None] * len(procs)
    while any(c is None for c in codes):
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            print(f"timed out after {args.timeout} s", file=sys.stderr)
            return 124
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    return max((abs(c) if c is not None else 1) for c in codes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to launch (no torchrun)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
