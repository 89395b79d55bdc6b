"""The support matrix: what every registered backend declares, as data, text or markdown.

Read from each backend's ``Capabilities`` (and its registered ``FormPolicy``), never written
by hand: ``python -m attn_dispatch matrix`` prints it, and the who-serves-what tables of
README.md and docs/ are blocks of its output that a test regenerates. Every public field of
``Capabilities`` is a row, so a field added there shows up here without a change to this
module. Imports no torch.

    >>> from attn_dispatch._matrix import format_matrix, support_matrix
    >>> print(format_matrix(support_matrix(backends=["native", "torch"]), "text",
    ...                     fields=["kinds", "phases"]))
            native                   torch
    ------  -----------------------  -----------------------
    kinds   mha, mla                 mha, mla
    phases  prefill, decode, verify  prefill, decode, verify
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._registry import DEFAULT_REGISTRY
from attn_dispatch._registry import BackendEntry
from attn_dispatch._registry import Registry
from attn_dispatch._table import format_table

FORMATS = ("text", "markdown", "json")

_HEAD = ("kinds", "phases", "devices", "dtypes", "kv_dtypes", "variants", "forms", "form_policy")
_TAIL = ("requires", "min_compute_capability", "availability", "checks", "description")


def fields_of(caps_type: type[Capabilities] = Capabilities) -> tuple[str, ...]:
    """The matrix rows of a ``Capabilities`` class: every public dataclass field, plus the
    registry entry's ``form_policy``. What users ask first comes first, then the rest in
    declaration order (so a field added to ``Capabilities`` appears without a change here),
    then what the backend needs to run, and the prose."""
    declared = [f.name for f in dataclasses.fields(caps_type) if not f.name.startswith("_")]
    return (
        *(f for f in _HEAD if f in declared or f == "form_policy"),
        *(f for f in declared if f not in _HEAD and f not in _TAIL),
        *(f for f in _TAIL if f in declared),
    )


#: The rows of the ``Capabilities`` class itself.
FIELDS = fields_of()
#: Shown unless asked for by name (long prose; in the JSON output always).
_ON_REQUEST = frozenset({"description"})
# What None means in the fields where it is not "nothing" (see Capabilities).
_NONE_MEANS = {
    "head_dims": "any",
    "v_head_dims": "any",
    "page_sizes": "any",
    "kv_dtypes": "same as dtypes",
}

Matrix = dict[str, dict[str, Any]]


def support_matrix(
    registry: Registry | None = None, *, backends: Iterable[str] | None = None
) -> Matrix:
    """``{backend: {field: value}}`` with JSON-ready values, every backend sorted by name.

    Sets become sorted lists (phases in forward order), a per-phase field a mapping
    ``{"prefill": [...], "decode": [...], "verify": [...]}``, functions (``checks``,
    ``availability``) their names. ``backends``: only these (each must be registered).
    """
    registry = DEFAULT_REGISTRY if registry is None else registry
    entries = registry.entries()
    if backends is not None:
        entries = {n: registry.get(n, context="matrix --backends") for n in backends}
    return {name: _row(entry) for name, entry in sorted(entries.items())}


def _row(entry: BackendEntry) -> dict[str, Any]:
    caps = entry.capabilities
    row = {f: _value(getattr(caps, f, None)) for f in fields_of(type(caps))}
    row["form_policy"] = _policy(entry.form_policy)
    return row


def _value(value: object) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        # A per-phase declaration (forms, variants): every phase, in forward order.
        by_phase = {Phase.parse(p): v for p, v in value.items()}
        return {p.name.lower(): _value(by_phase.get(p, frozenset())) for p in Phase}
    if callable(value):
        return getattr(value, "__name__", repr(value)).lstrip("_")
    if isinstance(value, tuple) and not value:
        return []
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return list(value)  # a version-like pair (min_compute_capability): keep its order
    if isinstance(value, Phase):
        return value.name.lower()
    if isinstance(value, (set, frozenset)):
        if all(isinstance(v, Phase) for v in value):
            return [p.name.lower() for p in sorted(value)]
        return sorted((_value(v) for v in value), key=lambda v: (isinstance(v, str), v))
    return [_value(v) for v in value]  # type: ignore[attr-defined]


def _policy(policy: FormPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        v = getattr(policy, f.name)
        out[f.name] = getattr(v, "value", v)
    return out


def _select(matrix: Matrix, fields: Sequence[str] | None) -> list[str]:
    # Every row any backend has, in the first order seen (a subclass may add fields).
    known = list(dict.fromkeys([*FIELDS, *(f for row in matrix.values() for f in row)]))
    if fields is None:
        return [f for f in known if f not in _ON_REQUEST]
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise InvalidSpecError(
            "fields", ",".join(unknown), f"unknown matrix field; choose from {', '.join(known)}"
        )
    return list(fields)


def format_matrix(matrix: Matrix, fmt: str = "text", *, fields: Sequence[str] | None = None) -> str:
    """The matrix as ``"text"`` (a row per field, a column per backend), ``"markdown"`` (the
    same as a table) or ``"json"`` (``{backend: {field: value}}``). ``fields``: these rows, in
    this order (default: all but ``description``; JSON: all)."""
    if fmt not in FORMATS:
        raise InvalidSpecError("format", fmt, f"choose one of {', '.join(FORMATS)}")
    if fmt == "json":
        if fields is None:
            return json.dumps(matrix, indent=2)
        keep = _select(matrix, fields)
        return json.dumps({b: {f: row.get(f) for f in keep} for b, row in matrix.items()}, indent=2)
    keep = _select(matrix, fields)
    names = list(matrix)
    rows = [(f, *(render(f, matrix[b].get(f)) for b in names)) for f in keep]
    if fmt == "text":
        return format_table(("", *names), _wrapped(rows))
    return _markdown(("", *(f"`{b}`" for b in names)), [(f"`{r[0]}`", *r[1:]) for r in rows])


def _wrapped(rows: Sequence[Sequence[str]], width: int = 36) -> list[tuple[str, ...]]:
    """Long cells folded onto continuation rows at ``"; "`` or ``", "`` (plain text)."""
    out: list[tuple[str, ...]] = []
    for row in rows:
        cells = [_fold(c, width) for c in row]
        for i in range(max(map(len, cells))):
            out.append(tuple(c[i] if i < len(c) else "" for c in cells))
    return out


def _fold(cell: str, width: int) -> list[str]:
    lines = [""]
    for part in re.split(r"(?<=[;,] )", cell):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines[-1] = lines[-1].rstrip()
            lines.append("  ")
        lines[-1] += part
    return lines


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


def render(field: str, value: Any) -> str:
    """One cell: ``value`` (a ``support_matrix`` value of ``field``) in words."""
    if value is None:
        return _NONE_MEANS.get(field, "-")
    if field == "form_policy":
        return _render_policy(value)
    if field == "min_compute_capability":
        return f"sm{value[0]}{value[1]}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        cells = {p: render(field, v) for p, v in value.items()}
        if len(set(cells.values())) == 1:
            return next(iter(cells.values()))
        return "; ".join(f"{p}: {c}" for p, c in cells.items())
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    return str(value)


def _render_policy(p: Mapping[str, Any]) -> str:
    prefill = [("no prefix", p["no_prefix"])]
    if p["short_prefix"] == p["long_prefix"]:
        prefill.append(("with prefix", p["short_prefix"]))
    else:
        limit = p["short_prefix_max"]
        prefill += [(f"prefix <= {limit}", p["short_prefix"]), ("longer", p["long_prefix"])]
    if len({form for _, form in prefill}) == 1:
        head = f"prefill {prefill[0][1]}"
    else:
        head = "prefill " + ", ".join(f"{form} ({when})" for when, form in prefill)
    return f"{head}; decode {p['decode']}; verify {p['verify']}"


# -- README blocks ------------------------------------------------------------------------------

#: A generated block: the command on its opening marker, its output up to the closing one.
_BLOCK = re.compile(
    r"(?P<open><!-- generated: python -m attn_dispatch matrix(?P<args>[^>]*?) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)


def render_blocks(text: str, render_args: Callable[[list[str]], str]) -> str:
    """``text`` with every generated block's body replaced by ``render_args(args)``, the
    output of the command its opening marker names (``args`` as split words)."""

    def sub(m: re.Match[str]) -> str:
        return m["open"] + render_args(m["args"].split()) + "\n" + m["close"]

    return _BLOCK.sub(sub, text)


def block_commands(text: str) -> list[list[str]]:
    """The argument lists of the generated blocks in ``text`` (for tests and messages)."""
    return [m["args"].split() for m in _BLOCK.finditer(text)]


__all__ = [
    "FIELDS",
    "FORMATS",
    "block_commands",
    "fields_of",
    "format_matrix",
    "render",
    "render_blocks",
    "support_matrix",
]
