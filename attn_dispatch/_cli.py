"""Command line: `python -m attn_dispatch list | explain | demo`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from attn_dispatch._binding import _check_forms
from attn_dispatch._binding import bind
from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._phase import Phase
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


def _config_of(args: argparse.Namespace) -> AttnConfig:
    kv_heads = (
        args.kv_heads if args.kv_heads is not None else (1 if args.kind == "mla" else args.heads)
    )
    return AttnConfig(
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
        mha_head_dim=args.mha_head_dim,
        mha_v_head_dim=args.mha_v_head_dim,
        sm_scale=args.sm_scale,
    )


def _verdict(why: list[str]) -> str:
    return "ok" if not why else f"no ({len(why)})"


def cmd_explain(args: argparse.Namespace, registry: Registry) -> int:
    """Which backend serves each phase, and every reason one cannot, split by origin.

    Reasons "from the config" hold on every machine; reasons "from this machine" (a module
    that is not importable, no CUDA, a GPU too old) say nothing about the machine the config
    is meant for. ``--static`` checks a config for another machine: only the first kind
    decides the exit status, and no backend is built.
    """
    spec = BackendSpec.parse(args.spec)
    config = _config_of(args)
    print(f"config: {config}")
    print(f"spec:   {spec}")
    rows = []
    from_config: list[str] = []
    from_machine: list[str] = []
    entries = {}
    counts: list[int] = []
    for phase in Phase:
        name = spec.names[phase]
        if name not in entries:
            entries[name] = registry.get(name, context=f"phase {phase.name.lower()!r}")
        caps = entries[name].capabilities
        c_why = caps.config_reasons(config, phase)
        m_why = caps.machine_reasons(config)
        rows.append((phase.name.lower(), name, _verdict(c_why), _verdict(m_why)))
        counts.append(len(c_why))
        label = f"{phase.name.lower()} -> {name!r}"
        from_config += [f"  - {label}: {r}" for r in c_why]
        from_machine += [f"  - {label}: {r}" for r in dict.fromkeys(m_why)]
    if config.kind == "mla":
        # The form policies: what each may choose must be served (from the entries alone).
        form_why: dict[Phase, tuple[str, list[str]]] = {}
        _check_forms(spec, config, entries, {}, form_why, machine=False)
        for phase, (name, why) in form_why.items():
            from_config += [f"  - {phase.name.lower()} -> {name!r}: {r}" for r in why]
            i = list(Phase).index(phase)
            counts[i] += len(why)
            rows[i] = (rows[i][0], rows[i][1], _verdict(["x"] * counts[i]), rows[i][3])
    print(format_table(("phase", "backend", "config", "this machine"), rows))
    if from_config:
        print("\nfrom the config (hold on every machine):")
        print("\n".join(from_config))
    if from_machine:
        print("\nfrom this machine's runtime (modules, CUDA, compute capability):")
        print("\n".join(dict.fromkeys(from_machine)))
    if args.static:
        verdict = "cannot" if from_config else "can"
        print(
            f"\nstatic check: the config {verdict} be served by these backends on a machine "
            "that has what they need"
        )
        return 1 if from_config else 0
    if from_config or from_machine:
        return 1
    try:
        binding = bind(spec, config, label=args.label, registry=registry)
    except IncompatibleBackendError as exc:
        print(str(exc))
        return 1
    print("\nbinds on this machine:")
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
    e.add_argument("--mha-head-dim", type=int, default=None, help="MLA: decompressed q/k dim")
    e.add_argument("--mha-v-head-dim", type=int, default=None, help="MLA: decompressed v dim")
    e.add_argument("--sm-scale", type=float, default=None, help="the planned softmax scale")
    e.add_argument("--label", default=None)
    e.add_argument(
        "--static",
        action="store_true",
        help="check the config for another machine: only reasons from the config decide; "
        "this machine's (no CUDA, missing modules) are listed apart; nothing is built",
    )
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
        return cmd_explain(args, DEFAULT_REGISTRY if registry is None else registry)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


__all__ = ["Capabilities", "main"]
