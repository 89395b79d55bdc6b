"""Command line: `python -m attn_dispatch list | explain | demo`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from attn_dispatch._binding import bind
from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._registry import DEFAULT_REGISTRY
from attn_dispatch._registry import Registry
from attn_dispatch._spec import BackendSpec
from attn_dispatch._table import format_table


def _join(values: object) -> str:
    return ",".join(sorted(str(getattr(v, "name", v)).lower() for v in values))  # type: ignore[attr-defined]


def cmd_list(args: argparse.Namespace, registry: Registry) -> int:
    rows = []
    backends = registry.list()
    for name, caps in backends.items():
        why = caps.availability_reasons()
        rows.append(
            (
                name,
                _join(caps.kinds),
                _join(caps.phases),
                _join(caps.devices),
                _join(caps.dtypes),
                "yes" if not why else "no: " + "; ".join(why),
            )
        )
    # A plugin that failed to load is listed too, with its error: never silently missing.
    for name, error in sorted(registry.plugin_errors.items()):
        if name not in backends:
            rows.append((name, "-", "-", "-", "-", f"no: plugin failed to load: {error}"))
    print(format_table(("backend", "kinds", "phases", "devices", "dtypes", "available"), rows))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    spec = BackendSpec.parse(args.spec)
    kv_heads = (
        args.kv_heads if args.kv_heads is not None else (1 if args.kind == "mla" else args.heads)
    )
    config = AttnConfig(
        kind=args.kind,
        num_q_heads=args.heads,
        num_kv_heads=kv_heads,
        head_dim=args.head_dim,
        v_head_dim=args.v_head_dim,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        device=args.device,
        tree_verify=args.tree_verify,
    )
    print(f"config: {config}")
    print(f"spec:   {spec}")
    try:
        binding = bind(spec, config, label=args.label)
    except IncompatibleBackendError as exc:
        print(str(exc))
        return 1
    print(format_table(("phase", "backend"), binding.table()))
    return 0


def cmd_demo(argv: Sequence[str]) -> int:
    demo = importlib.import_module("attn_dispatch.demo")
    return int(demo.main(list(argv)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attn_dispatch",
        description="Per-runner attention kernel dispatch: inspect backends and bindings.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list registered backends and whether they can run here")
    e = sub.add_parser("explain", help="show which backend serves each phase, or every reason")
    e.add_argument(
        "--spec", required=True, help="e.g. 'prefill=triton,decode=flashinfer' or 'torch'"
    )
    e.add_argument("--kind", choices=("mha", "mla"), required=True)
    e.add_argument("--heads", type=int, required=True, help="query heads")
    e.add_argument("--kv-heads", type=int, default=None, help="KV heads (MLA: 1)")
    e.add_argument("--head-dim", type=int, required=True, help="q/k head dim (MLA: latent + rope)")
    e.add_argument("--v-head-dim", type=int, default=None, help="v head dim (MLA: latent)")
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--kv-dtype", default=None)
    e.add_argument("--page-size", type=int, default=1)
    e.add_argument("--device", default="cpu")
    e.add_argument("--tree-verify", action="store_true", help="verify uses a tree mask")
    e.add_argument("--label", default=None)
    sub.add_parser(
        "demo", help="run the speculative-decoding demo (see --help of demo)", add_help=False
    )
    return p


def main(argv: Sequence[str] | None = None, *, registry: Registry | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return cmd_demo(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return cmd_list(args, DEFAULT_REGISTRY if registry is None else registry)
        return cmd_explain(args)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["Capabilities", "main"]
