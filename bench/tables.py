"""A tuned dispatch table's spec against the best single-backend spec, on the demo's models.

    python bench/tables.py [--demo base] [--quick] [--repeats 5] [--table PATH]

For each runner of the demo (``target``: the MLA model; ``draft``: its small GQA model), the
script tunes a dispatch table here (``tune_table``, prefill at three prompt lengths, decode and
verify at three contexts, so shape buckets are emitted where the measurements show they pay),
then times one forward (a plan and one call per layer of the model) of every spec on the same
workload: every phase at every size the table was tuned at. The specs: the table's (with its
buckets), the table's without buckets (one backend per phase), and each single backend that
serves every phase (the reference ``torch`` only with ``--with-torch``: it is the
slowest everywhere, and timing it dominates the run). Contenders alternate round by round
in one process (medians of ``--repeats``), so a burst of load hits all alike. The summary
is the workload's total time per spec and ``table / best single`` (< 1: the table is
faster).

A table tuned and timed in one run is fresh by construction; ``--table PATH`` also saves it.
The header names the machine, the ISA path ``native`` runs, torch's threads and the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import BackendSpec  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch import attention  # noqa: E402
from attn_dispatch import attn_scope  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch import check  # noqa: E402
from attn_dispatch.dispatch_table import tune_table  # noqa: E402
from attn_dispatch.tune import TuneSizes  # noqa: E402
from attn_dispatch.tune import _batch_for  # noqa: E402
from attn_dispatch.tune import machine_name  # noqa: E402

BACKENDS = ("torch", "sdpa", "native")


def demo_configs(size: str, dtype: str) -> tuple[dict[str, AttnConfig], dict[str, int]]:
    """The demo's two runners' configs (as ``tune --demo`` builds them) and layer counts."""
    from attn_dispatch.demo.factory import sizes
    from attn_dispatch.demo.models import build_models
    from attn_dispatch.demo.values import DemoOptions

    s = sizes()[size]
    target, draft = build_models(
        s.target, s.draft, seed=0, dtype=getattr(torch, dtype), device="cpu"
    )
    page = DemoOptions().page_size
    configs = {
        "target": target.attn_config(page_size=page, device="cpu"),
        "draft": draft.attn_config(page_size=1, device="cpu"),
    }
    # MLA is timed in the absorbed form, as tune times it (the decompressed forms need the
    # model's own K/V expansion, which a kernel-level workload does not have).
    configs = {
        k: c.replace(mha_head_dim=None, mha_v_head_dim=None) if c.kind == "mla" else c
        for k, c in configs.items()
    }
    return configs, {"target": s.target.layers, "draft": s.draft.layers}


def workload(config: AttnConfig, sizes: TuneSizes) -> list[tuple[str, Any]]:
    """(label, (batch, q, k, v, extras)) per phase x size the table was tuned at."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for phase in Phase:
        for n in sizes.sizes_of(phase):
            at = sizes.at(phase, n)
            what = "q_len" if phase is Phase.PREFILL else "context"
            out.append((f"{phase.name.lower()} {what} {n}", _batch_for(config, phase, at, gen)))
    return out


def forward_ms(binding: Any, case: Any, layers: int, config: AttnConfig) -> float:
    batch, q, k, v, extras = case
    kw = dict(extras)
    if config.sm_scale is None:
        kw["sm_scale"] = 1.0 / math.sqrt(config.head_dim)
    t0 = time.perf_counter()
    with attn_scope(binding, batch):
        for _ in range(layers):
            attention(q, k, v, **kw)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--demo", choices=("tiny", "base", "wide"), default=None, help="base (--quick: tiny)"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 repeats (a smoke run)")
    ap.add_argument("--table", type=Path, default=None, help="also save the tuned table here")
    ap.add_argument(
        "--with-torch",
        action="store_true",
        help="also time the reference (torch) as a single-backend spec (slow; never the best)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        sizes = TuneSizes(prefill_batch=1, prefill_len=32, prefill_lens=(8, 128),
                          decode_batch=2, context=64, contexts=(16, 256), repeats=2)  # fmt: skip
        repeats = 2
    else:
        sizes = TuneSizes(prefill_batch=2, prefill_len=128, prefill_lens=(32, 512),
                          decode_batch=4, context=256, contexts=(64, 1024), repeats=5)  # fmt: skip
        repeats = args.repeats
    if args.demo is None:
        args.demo = "tiny" if args.quick else "base"
    configs, layers = demo_configs(args.demo, args.dtype)
    print(f"machine: {machine_name('cpu')}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"demo {args.demo!r}, dtype {args.dtype}; tuned at {sizes}")
    t0 = time.perf_counter()
    names = [n for n in BACKENDS if all(not check(n, c) for c in configs.values())]
    table = tune_table({label: {"": c} for label, c in configs.items()}, sizes=sizes,
                       backends=[n for n in BACKENDS if n in names or n == "torch"])  # fmt: skip
    print(f"tuned in {time.perf_counter() - t0:.1f} s (fingerprint {table.fingerprint()})")
    if args.table is not None:
        table.save(args.table)
    totals: dict[str, dict[str, float]] = {}
    for label, config in configs.items():
        spec = table.spec(label)
        assert isinstance(spec, BackendSpec)
        contenders = {"table": spec, "table, no buckets": dataclasses.replace(spec, buckets=())}
        for n in names:
            if n != "torch" or args.with_torch:
                contenders[n] = BackendSpec.uniform(n)
        bindings = {k: bind(s, config, label=label) for k, s in contenders.items()}
        cases = workload(config, sizes)
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(repeats + 1):
            for shape, case in cases:
                for k, b in bindings.items():
                    ms = forward_ms(b, case, layers[label], config)
                    if r:  # round 0 warms up
                        times.setdefault((shape, k), []).append(ms)
        print(f"\nrunner {label!r} ({layers[label]} layers): table spec {spec}")
        print(table.explain(label))
        head = f"{'shape':<22}" + "".join(f"{k:>20}" for k in bindings)
        print(head)
        total = dict.fromkeys(bindings, 0.0)
        for shape, _ in cases:
            row = f"{shape:<22}"
            for k in bindings:
                med = statistics.median(times[(shape, k)])
                total[k] += med
                row += f"{med:>17.3f} ms"
            print(row)
        print(f"{'total':<22}" + "".join(f"{total[k]:>17.3f} ms" for k in bindings))
        totals[label] = total
    print("\nsummary (workload total, ms; ratio < 1: the table spec is faster)")
    for label, total in totals.items():
        singles = {k: v for k, v in total.items() if not k.startswith("table")}
        best = min(singles, key=lambda k: singles[k])
        print(
            f"  {label}: table {total['table']:.3f}, table without buckets "
            f"{total['table, no buckets']:.3f}, best single {best!r} {singles[best]:.3f}: "
            f"table / best single {total['table'] / singles[best]:.3f}, "
            f"table / no buckets {total['table'] / total['table, no buckets']:.3f}"
        )
    print(f"load at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
