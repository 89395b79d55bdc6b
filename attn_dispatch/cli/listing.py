"""``python -m attn_dispatch list``: the registered backends and whether they can run here."""

from __future__ import annotations

import argparse

from attn_dispatch._registry import Origin
from attn_dispatch._registry import Registry
from attn_dispatch._table import format_table


def _join(values: object) -> str:
    return ",".join(sorted(str(getattr(v, "name", v)).lower() for v in values))  # type: ignore[attr-defined]


def _dist(origin: Origin | None) -> tuple[str, str]:
    # "-": registered by code at run time, or an entry point without distribution metadata.
    if origin is None:
        return "-", "-"
    return origin.distribution or "-", origin.version or "-"


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
                *_dist(registry.origin(name)),
                "yes" if not why else "no: " + "; ".join(why),
            )
        )
    # A plugin that failed to load or was left out is listed too, with the reason: never
    # silently missing.
    origins = registry.plugin_origins
    for kind, records in (
        ("plugin failed to load", registry.plugin_errors),
        ("plugin not loaded", registry.plugins_blocked),
    ):
        for name, reason in sorted(records.items()):
            if name not in backends:
                dist = _dist(origins.get(name))
                rows.append((name, "-", "-", "-", "-", *dist, f"no: {kind}: {reason}"))
    header = ("backend", "kinds", "phases", "devices", "dtypes", "distribution", "version")
    print(format_table((*header, "available"), rows))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("list", help="list registered backends and whether they can run here")
