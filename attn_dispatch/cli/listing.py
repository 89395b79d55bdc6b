"""``python -m attn_dispatch list``: the registered backends and whether they can run here."""

from __future__ import annotations

import argparse

from attn_dispatch._registry import Registry
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("list", help="list registered backends and whether they can run here")
