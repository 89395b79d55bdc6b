"""``python -m attn_dispatch tune``: time every backend per layer group x phase, recommend a spec.

It recommends; it never changes a binding. The timings are this machine's (its CPU, the ISA
path native runs, torch's thread count), printed with the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._registry import Registry
from attn_dispatch.cli import explain

__all__ = ["add_parser", "cmd_tune"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser(
        "tune",
        help="time every backend per layer group and phase on this machine; recommend a spec",
        description="Times every backend that can serve each layer group x phase (prefill, "
        "decode, verify) at sizes derived from the shapes (or given), and prints the table "
        "and the fastest spec per group. It recommends; it never binds anything for you.",
    )
    explain.add_shape_arguments(t)
    t.add_argument(
        "--backends",
        type=backend_names,
        help="comma-separated candidates (default: every available one)",
    )
    t.add_argument("--prefill-len", type=int, default=512, help="prompt tokens per request")
    t.add_argument("--prefill-batch", type=int, default=2)
    t.add_argument("--decode-batch", type=int, default=8, help="requests in decode/verify")
    t.add_argument("--context", type=int, default=1024, help="tokens in the cache per request")
    t.add_argument("--draft-tokens", type=int, default=4, help="verify: new tokens per request")
    t.add_argument("--repeats", type=int, default=5, help="timed calls per cell (after warm-up)")
    t.add_argument(
        "--prefill-lens",
        type=sizes_list,
        default=(),
        metavar="N,N",
        help="more prompt lengths to time prefill at: shape buckets by q_len where the winner "
        "changes by more than the noise (e.g. 128,2048)",
    )
    t.add_argument(
        "--contexts",
        type=sizes_list,
        default=(),
        metavar="N,N",
        help="more contexts to time decode and verify at: shape buckets by context (e.g. 256,8192)",
    )
    t.add_argument(
        "--demo",
        choices=("tiny", "base", "wide"),
        help="tune the demo's two runners at this size (groups 'target' and 'draft'; the "
        "dtype is --dtype or float32); replaces the shape flags and --model",
    )
    t.add_argument("--format", choices=("text", "json"), default="text")
    t.add_argument(
        "--save",
        metavar="FILE",
        help="also write a dispatch table (winner and runner-up per runner, group and phase, "
        "with the environment it holds for) for spec_from_table (docs/guides/tune.md)",
    )
    t.add_argument(
        "--label",
        default="model",
        help="the runner label the table files these groups under (default 'model'; the "
        "demo's runners are 'target' and 'draft')",
    )


def sizes_list(text: str) -> tuple[int, ...]:
    """``--prefill-lens 128,2048``: one or more ints >= 1."""
    try:
        values = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers, e.g. 128,2048") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1")
    return values


def backend_names(text: str) -> list[str]:
    """``--backends a,b``: at least one name, each once (``,`` alone names none: refused,
    not a run that times nothing)."""
    names = [w.strip() for w in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"{text!r} names no backend; e.g. --backends torch,native")
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name between commas")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(twice)} more than once")
    return names


def _demo_configs(args: argparse.Namespace) -> tuple[dict[str, AttnConfig], list[str]]:
    import torch

    from attn_dispatch.demo.factory import sizes
    from attn_dispatch.demo.models import build_models
    from attn_dispatch.demo.values import DemoOptions

    size = sizes()[args.demo]
    dtype = args.dtype or "float32"
    target, draft = build_models(
        size.target, size.draft, seed=0, dtype=getattr(torch, dtype), device=args.device
    )
    page = DemoOptions().page_size
    configs = {
        "target": target.attn_config(page_size=page, device=args.device),
        "draft": draft.attn_config(page_size=1, device=args.device),
    }
    return configs, [f"demo: size {args.demo!r}, dtype {dtype}: the target and its draft"]


def cmd_tune(args: argparse.Namespace, registry: Registry) -> int:
    from attn_dispatch.tune import TuneSizes
    from attn_dispatch.tune import check_device
    from attn_dispatch.tune import tune

    # Before anything is built for it (the demo's models, the batches): tune measures this
    # machine, so the device must be one of its own.
    check_device(args.device)
    got = _demo_configs(args) if args.demo else explain.layer_configs(args)
    if isinstance(got, str):
        print(f"model: {args.model}\ncannot serve this model: {got}")
        return 1
    configs, header = got
    sizes = TuneSizes(
        prefill_batch=args.prefill_batch,
        prefill_len=args.prefill_len,
        decode_batch=args.decode_batch,
        context=args.context,
        draft_tokens=args.draft_tokens,
        repeats=args.repeats,
        prefill_lens=args.prefill_lens,
        contexts=args.contexts,
    )
    report = tune(configs, sizes=sizes, backends=args.backends, registry=registry)
    if args.save:
        _save_table(args, report, configs)
    if args.format == "json":
        print(report.to_json())
        return 0
    for line in header:
        print(line)
    print(report.table())
    return 0


def _save_table(args: argparse.Namespace, report: Any, configs: dict[str, AttnConfig]) -> None:
    from attn_dispatch.dispatch_table import DispatchTable
    from attn_dispatch.dispatch_table import DispatchTableError

    if args.demo:  # each demo group is a runner of its own, with one kind of layer
        per_label = {g: {"": c} for g, c in configs.items()}
        reports = {
            g: dataclasses.replace(
                report,
                timings=tuple(
                    dataclasses.replace(t, group="") for t in report.timings if t.group == g
                ),
            )
            for g in configs
        }
    else:
        per_label = {args.label: configs}
        reports = {args.label: report}
    table = DispatchTable.from_reports(reports, per_label)
    try:
        table.save(args.save)
    except OSError as exc:
        raise DispatchTableError(args.save, "file", f"cannot write it: {exc}") from None
    print(f"saved dispatch table {args.save} ({table.fingerprint()})", file=sys.stderr)
