"""``python -m attn_dispatch explain``: which backend serves each group and phase of a config
(or of a model config), and every reason one cannot, with bind's own checks."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path

from attn_dispatch._binding import bind
from attn_dispatch._binding import check
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._registry import Registry
from attn_dispatch._spec import BackendSpec
from attn_dispatch._table import format_table
from attn_dispatch.cli._files import read_regular
from attn_dispatch.cli.model import UnsupportedModel
from attn_dispatch.cli.model import model_configs


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


_DEVICE = re.compile(r"[a-z][a-z0-9_]*(:\d+)?")


def _device(text: str) -> str:
    """A device name as torch writes one ("cpu", "cuda", "cuda:1"); checked here because a
    config may be meant for another machine, whose devices this one cannot list."""
    if not _DEVICE.fullmatch(text.strip().lower()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device name; use a type with an optional index: 'cpu', "
            "'cuda', 'cuda:1'"
        )
    return text.strip().lower()


def _value(text: str) -> object:
    """A ``--group`` value: none/true/false, an int, a float, else the text."""
    low = text.strip().lower()
    if low in ("none", "null", ""):
        return None
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    return text.strip()


def _group_arg(text: str) -> tuple[str, dict[str, object]]:
    """``NAME[:FIELD=VALUE,...]`` -> (name, AttnConfig changes)."""
    name, _, rest = text.partition(":")
    changes: dict[str, object] = {}
    for item in _words(rest):
        field, eq, value = item.partition("=")
        field = field.strip().replace("-", "_")
        if not eq or field not in AttnConfig.__dataclass_fields__:
            raise argparse.ArgumentTypeError(
                f"{item!r} in --group {text!r}: write FIELD=VALUE with an AttnConfig field "
                "(e.g. window_left=4095, logit_cap=50, sinks=true, kv_dtype=fp8)"
            )
        changes[field] = _value(value)
    if not name.strip():
        raise argparse.ArgumentTypeError(f"--group {text!r} names no group (e.g. 'sliding')")
    return name.strip(), changes


def _spec_of(
    items: Sequence[str], groups: Sequence[str] | None
) -> BackendSpec | dict[str, BackendSpec]:
    """``--spec torch`` for every group, or ``--spec GROUP:SPEC`` once per group."""
    pairs = []
    for item in items:
        head, colon, rest = item.partition(":")
        pairs.append((head.strip(), rest) if colon and "=" not in head else (None, item))
    if len(pairs) == 1 and pairs[0][0] is None:
        return BackendSpec.parse(pairs[0][1])
    named = {g: BackendSpec.parse(s) for g, s in pairs if g is not None}
    if len(named) != len(pairs) or groups is None or sorted(named) != sorted(groups):
        raise InvalidSpecError(
            "--spec",
            list(items),
            "give one spec for all groups, or GROUP:SPEC once for each group "
            f"({', '.join(groups or ['no groups here'])})",
        )
    return named


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
        dtype=args.dtype or "bfloat16",
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        device=args.device,
        tree_verify=args.tree_verify,
        mha_head_dim=args.mha_head_dim,
        mha_v_head_dim=args.mha_v_head_dim,
        sm_scale=args.sm_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
        sinks=bool(args.sinks),
    )


def _configs(args: argparse.Namespace) -> dict[str, AttnConfig]:
    """Group -> config for ``--group``s, or ``{"": config}`` for one config."""
    base = _config_of(args)
    if not args.group:
        return {"": base}
    groups: dict[str, AttnConfig] = {}
    for name, changes in args.group:
        if name in groups:
            raise InvalidSpecError("--group", name, "each group is named once")
        groups[name] = base.replace(**changes)
    return groups


def _verdict(why: Sequence[str]) -> str:
    return "ok" if not why else f"no ({len(why)})"


def cmd_explain(args: argparse.Namespace, registry: Registry) -> int:
    """Which backend serves each group and phase, and every reason one cannot, by origin.

    Reasons "from the config" hold on every machine; reasons "from this machine" (a module
    that is not importable, no CUDA, a GPU too old) say nothing about the machine the config
    is meant for. ``--static`` checks a config for another machine: only the first kind
    decides the exit status, and no backend is built. The checks are ``bind``'s own.
    """
    header: list[str] = []
    if args.model is not None:
        try:
            targets, header = model_configs(args)
        except UnsupportedModel as exc:
            print(f"model: {args.model}\ncannot serve this model: {exc}")
            return 1
    else:
        targets = _configs(args)
    grouped = "" not in targets
    if args.table is not None:
        spec = _table_spec(args, list(targets) if grouped else None, header)
    else:
        spec = _spec_of(args.spec, list(targets) if grouped else None)
    for line in header:
        print(line)
    for name, cfg in targets.items():
        print(f"group {name!r}: {cfg}" if grouped else f"config: {cfg}")
    print(f"spec:   {_spec_text(spec)}")
    rows = []
    # (group, backend, reason) -> the phases it holds in: one line for all of them.
    from_config: dict[tuple[str, str, str], list[str]] = {}
    from_machine: dict[tuple[str, str], None] = {}
    for group, cfg in targets.items():
        gspec = spec[group] if isinstance(spec, dict) else spec
        found = _config_reasons(gspec, cfg, args.label, registry)
        for phase in Phase:
            name, why = found.get(phase, (gspec.names[phase], []))
            # The machine's reasons depend on the backend and the device, not on the phase;
            # a phase with shape buckets is served by each bucket's backend.
            b = gspec.buckets_for(phase)
            used = dict.fromkeys((gspec.names[phase], *(() if b is None else b.names)))
            m_pairs = [
                (n, r) for n in used for r in registry.get(n).capabilities.machine_reasons(cfg)
            ]
            shown = name if b is None else gspec.phase_text(phase)
            cells = (phase.name.lower(), shown, _verdict(why), _verdict([r for _, r in m_pairs]))
            rows.append((group, *cells) if group else cells)
            for r in why:
                from_config.setdefault((group, name, r), []).append(phase.name.lower())
            from_machine.update(dict.fromkeys(m_pairs))
    head = ("phase", "backend", "config", "this machine")
    print(format_table(("group", *head) if grouped else head, rows))
    if from_config:
        print("\nfrom the config (hold on every machine):")
        for (group, name, r), phases in from_config.items():
            who = f"[{group}] " if group else ""
            print(f"  - {who}{','.join(phases)} -> {name!r}: {r}")
    if from_machine:
        print("\nfrom this machine's runtime (modules, CUDA, compute capability):")
        for name, r in from_machine:
            print(f"  - {name!r}: {r}")
    if args.static:
        verdict = "cannot" if from_config else "can"
        print(
            f"\nstatic check: the config {verdict} be served by these backends on a machine "
            "that has what they need"
        )
        return 1 if from_config else 0
    if from_config or from_machine:
        return 1
    return _bind_here(spec, targets, args.label, registry)


def _table_spec(
    args: argparse.Namespace, groups: Sequence[str] | None, header: list[str]
) -> BackendSpec | dict[str, BackendSpec]:
    """The spec a dispatch table holds for ``--label`` (checked for staleness), and where each
    choice came from (into ``header``)."""
    from attn_dispatch.dispatch_table import MAX_TABLE_BYTES
    from attn_dispatch.dispatch_table import DispatchTable
    from attn_dispatch.dispatch_table import spec_from_table

    # Only a regular file of bounded size is read (a FIFO would block the open forever).
    with contextlib.suppress(FileNotFoundError):  # the table's own loader names it
        read_regular(Path(args.table), "--table", MAX_TABLE_BYTES, what="a dispatch table")
    spec = spec_from_table(args.table, label=args.label)
    table = DispatchTable.load(args.table)
    label = args.label if args.label is not None else table.labels[0]
    held = sorted(spec) if isinstance(spec, dict) else None
    if held != (None if groups is None else sorted(groups)):
        raise InvalidSpecError(
            "--table",
            args.table,
            f"runner {label!r} of the table has groups {held or ['(one kind of layer)']!r}, "
            f"the layers given here {list(groups or ['(one kind of layer)'])!r}",
        )
    header.extend(table.explain(label).splitlines())
    return spec


def _spec_text(spec: BackendSpec | Mapping[str, BackendSpec]) -> str:
    if isinstance(spec, BackendSpec):
        return str(spec)
    return "; ".join(f"{g}: {s}" for g, s in spec.items())


def _config_reasons(
    spec: BackendSpec, config: AttnConfig, label: str | None, registry: Registry
) -> dict[Phase, tuple[str, list[str]]]:
    """Phase -> (backend, reasons from the config): bind's own checks (``check``), with the
    machine's left out (``explain`` lists those apart)."""
    found = check(spec, config, label=label, registry=registry, machine=False)
    return {p: (name, list(why)) for p, (name, why) in found.items()}


def _bind_here(
    spec: BackendSpec | dict[str, BackendSpec],
    targets: dict[str, AttnConfig],
    label: str | None,
    registry: Registry,
) -> int:
    try:
        if len(targets) == 1 and isinstance(spec, BackendSpec):
            # One group binds plain, as use() binds a model whose layers are all alike.
            binding = bind(spec, next(iter(targets.values())), label=label, registry=registry)
            table: list[tuple[str, ...]] = list(binding.table())
            head: tuple[str, ...] = ("phase", "backend")
        else:
            binding = bind(spec, targets, label=label, registry=registry)
            table = [(g, p, b) for g, sub in binding.groups.items() for p, b in sub.table()]
            head = ("group", "phase", "backend")
    except IncompatibleBackendError as exc:
        print(str(exc))
        return 1
    print("\nbinds on this machine:")
    print(format_table(head, table))
    return 0


def add_shape_arguments(e: argparse.ArgumentParser) -> None:
    """The flags that describe the layers (one shape, groups, or ``--model``): shared by
    ``explain`` and ``tune``."""
    e.add_argument(
        "--model",
        help="a transformers model directory or its config.json (read locally, the way use() "
        "maps it); replaces --kind/--heads/--head-dim and the variant flags",
    )
    e.add_argument("--kind", choices=("mha", "mla"))
    e.add_argument("--heads", type=int, help="query heads")
    e.add_argument("--kv-heads", type=int, default=None, help="KV heads (MLA: 1)")
    e.add_argument("--head-dim", type=int, help="q/k head dim (MLA: latent + rope)")
    e.add_argument("--v-head-dim", type=int, default=None, help="v head dim (MLA: latent)")
    e.add_argument("--dtype", default=None, help="default bfloat16 (--model: the config's)")
    e.add_argument("--kv-dtype", default=None, help="e.g. float8_e4m3fn (default: --dtype)")
    e.add_argument("--page-size", type=int, default=1)
    e.add_argument("--device", type=_device, default="cpu")
    e.add_argument("--tree-verify", action="store_true", help="verify uses a tree mask")
    e.add_argument("--mha-head-dim", type=int, default=None, help="MLA: decompressed q/k dim")
    e.add_argument("--mha-v-head-dim", type=int, default=None, help="MLA: decompressed v dim")
    e.add_argument("--sm-scale", type=float, default=None, help="the planned softmax scale")
    e.add_argument("--window-left", type=int, default=None, help="sliding window: keys p-W..p")
    e.add_argument("--logit-cap", type=float, default=None, help="soft-cap of the logits")
    e.add_argument(
        "--sinks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="learned attention sinks per head (--model: found as use() finds them)",
    )
    e.add_argument(
        "--group",
        type=_group_arg,
        action="append",
        metavar="NAME[:FIELD=VALUE,...]",
        help="a layer group: the config above with these AttnConfig fields changed; repeat "
        "for each group (e.g. --group sliding:window_left=4095 --group full)",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "explain",
        help="show which backend serves each phase (and group), or every reason",
        description="Check a spec against one layer shape (--kind, --heads, --head-dim, ...) "
        "or against a transformers model config (--model), with bind's own checks.",
    )
    e.add_argument(
        "--spec",
        action="append",
        help="e.g. 'prefill=triton,decode=flashinfer' or 'torch'; with groups, one for all or "
        "GROUP:SPEC once per group ('sliding:native')",
    )
    e.add_argument(
        "--table",
        metavar="FILE",
        help="instead of --spec: the spec of runner --label (or its only runner) in a dispatch "
        "table saved by `tune --save`, refused if stale; shows where each choice came from",
    )
    add_shape_arguments(e)
    e.add_argument("--label", default=None)
    e.add_argument(
        "--static",
        action="store_true",
        help="check the config for another machine: only reasons from the config decide; "
        "this machine's (no CUDA, missing modules) are listed apart; nothing is built",
    )


# Flags that describe one layer shape: --model derives them from the model config instead.
_SHAPE_FLAGS = (
    *("kind", "heads", "kv_heads", "head_dim", "v_head_dim", "mha_head_dim", "mha_v_head_dim"),
    *("window_left", "logit_cap", "group"),
)


def check_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: str = "explain"
) -> None:
    """Flags ``argparse`` cannot check alone (``--model`` against the shape flags)."""
    if command == "explain" and (args.spec is None) == (args.table is None):
        parser.error("explain: give --spec or --table FILE (one of them is required)")
    if getattr(args, "demo", None) is not None:
        given = [f for f in (*_SHAPE_FLAGS, "model") if getattr(args, f) not in (None, [])]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            parser.error(f"{command}: --demo names the layer shapes; drop {flags}")
        return
    if args.model is not None:
        given = [f for f in _SHAPE_FLAGS if getattr(args, f) not in (None, [])]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            parser.error(f"{command}: --model derives the layer shapes; drop {flags}")
        return
    missing = [f for f in ("kind", "heads", "head_dim") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        parser.error(f"{command}: the following arguments are required: {flags} (or --model)")


def layer_configs(args: argparse.Namespace) -> tuple[dict[str, AttnConfig], list[str]] | str:
    """Group -> config from ``--model`` or the shape flags, and header lines; or the reason
    the model cannot be served (a string)."""
    if args.model is not None:
        try:
            return model_configs(args)
        except UnsupportedModel as exc:
            return str(exc)
    return _configs(args), []
