"""assert_isolated: a runner dispatches the same with other runners alive as it does alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec
from attn_dispatch.testing._rows import DispatchRow
from attn_dispatch.testing._rows import Ledger
from attn_dispatch.testing._rows import config_changes
from attn_dispatch.testing._rows import format_rows
from attn_dispatch.testing._rows import phase_name
from attn_dispatch.testing._rows import record_rows


@dataclasses.dataclass(frozen=True, slots=True)
class Isolation:
    """What ``assert_isolated`` compared (returned when the runner passed): all rows of both
    workloads, and the runner's ledger (the same on both sides)."""

    runner: str
    alone: tuple[DispatchRow, ...]
    together: tuple[DispatchRow, ...]
    others: tuple[str | None, ...]

    @property
    def ledger(self) -> Ledger:
        return Ledger.of(self.runner, self.alone)

    def rows(self, side: str = "together") -> list[DispatchRow]:
        """The runner's own rows in ``side`` (``"alone"`` or ``"together"``)."""
        rows = self.alone if side == "alone" else self.together
        return [r for r in rows if r.runner == self.runner]


def _phases(allow: object, name: str) -> frozenset[str]:
    """The phase names an ``allow_*`` argument names: True (all), False, a phase or its
    name, or an iterable of them; anything else is ``InvalidSpecError``."""
    if allow is True:
        return frozenset(p.name.lower() for p in Phase)
    if allow is False:
        return frozenset()
    if isinstance(allow, (str, Phase)):
        allow = [allow]
    if not isinstance(allow, Iterable) or isinstance(allow, (bytes, Mapping)):
        raise InvalidSpecError(
            name, allow, "pass True (every phase), False, a phase name, or an iterable of them"
        )
    items = list(allow)
    for p in items:
        if not isinstance(p, (str, Phase)):
            raise InvalidSpecError(
                name, allow, f"{p!r} is not a phase; name phases as 'prefill', 'decode', 'verify'"
            )
    return frozenset(phase_name(p) for p in items)


def assert_isolated(
    label: str,
    alone: Callable[[], Any],
    together: Callable[[], Any],
    *,
    allow_call_count_diff: bool | Iterable[Phase | str] = (),
    allow_one_side: bool | Iterable[Phase | str] = (),
    expect: BackendSpec | str | None = None,
) -> Isolation:
    """Run ``alone`` (only runner ``label``) and ``together`` (``label`` with other runners
    co-resident), each under its own recorder, and compare ``label``'s dispatch rows.

    A row is (phase, layer group, backend, attention form, bound config fingerprint) with its
    call count, and what ran under the backend's name (the backend object's class, build and
    kernel options: ``kernel_options``), so a registry entry replaced under the same name
    is a difference too. For each (phase, group) both workloads ran, the two sides must have
    the same rows; their call counts must be equal too unless the phase is in
    ``allow_call_count_diff`` (a phase name, an iterable of them, or True for all: a
    speculative workload runs more verify and fewer decode steps). A (phase, group) only one
    side ran is a difference (whatever the counts allow: calls that vanished are not a count)
    unless its phase is in ``allow_one_side`` (the same forms: a plain workload runs no
    verify step at all). ``expect``: the runner's own spec; every row on both sides must name
    its backend (it checks the phases only one side ran, too).

    Start-up belongs in the workloads: build the runners inside ``alone`` and ``together``
    (in the order the framework does), since start-up is where most leaks happen.

    Raises AssertionError naming the runner, the first differing row on each side, the
    other runners alive, what differs (backend, form, config fields, counts) and the full
    rows; returns an ``Isolation`` when the runner is isolated.
    """
    for name, fn in (("alone", alone), ("together", together)):
        if not callable(fn):
            raise InvalidSpecError(
                name, fn, "pass a function of no arguments that starts the runners and serves"
            )
    if label is not None and not isinstance(label, str):
        raise InvalidSpecError("label", label, "pass the runner's label (a string), or None")
    allowed = _phases(allow_call_count_diff, "allow_call_count_diff")
    one_side = _phases(allow_one_side, "allow_one_side")
    spec = BackendSpec.parse(expect) if isinstance(expect, str) else expect
    if spec is not None and not isinstance(spec, BackendSpec):
        raise InvalidSpecError("expect", spec, "pass a BackendSpec, a spec string, or None")
    with record_rows() as rec:
        alone()
    alone_rows = tuple(rec.rows())
    with record_rows() as rec:
        together()
    together_rows = tuple(rec.rows())
    mine_a = [r for r in alone_rows if r.runner == label]
    mine_t = [r for r in together_rows if r.runner == label]
    others_t = tuple(_labels(r.runner for r in together_rows if r.runner != label))
    others_a = tuple(_labels(r.runner for r in alone_rows if r.runner != label))
    problems: list[str] = []
    hints: set[str] = set()
    first: tuple[DispatchRow | None, DispatchRow | None] | None = None
    for side, rows, everyone in (
        ("alone", mine_a, alone_rows),
        ("together", mine_t, together_rows),
    ):
        if not rows:
            seen = _names(_labels(r.runner for r in everyone)) or "none"
            problems.append(
                f"runner {label!r} made no attention calls in the {side!r} workload (runners "
                f"that did: {seen}); check the label, and that the workload runs a forward "
                "of this runner"
            )
    if spec is not None:
        bad: dict[str, DispatchRow | None] = {"alone": None, "together": None}
        for side, rows in (("alone", mine_a), ("together", mine_t)):
            for r in rows:
                want = spec.backend_for(Phase.parse(r.phase))
                if r.backend != want:
                    problems.append(
                        f"{side}: {r.phase} ran backend {r.backend!r}, but the spec expected "
                        f"for runner {label!r} ({spec}) names {want!r}"
                    )
                    bad[side] = bad[side] or r
        if bad["alone"] or bad["together"]:
            first = (bad["alone"], bad["together"])
    if mine_a and mine_t:
        diff_first, found = _first_difference(mine_a, mine_t, allowed, one_side, hints)
        first = first or diff_first
        problems.extend(found)
    if problems:
        checked = bool(mine_a and mine_t)
        raise AssertionError(
            _message(
                label,
                checked,
                problems,
                sorted(hints),
                first,
                (mine_a, mine_t),
                (others_a, others_t),
                together_rows,
                allowed,
                one_side,
            )
        )
    return Isolation(label, alone_rows, together_rows, others_t)


def _labels(labels: Iterable[str | None]) -> list[str | None]:
    return sorted(set(labels), key=lambda x: (x is None, x or ""))


def _names(labels: Iterable[str | None]) -> str:
    return ", ".join("unlabelled" if x is None else repr(x) for x in labels)


def _first_difference(
    alone: list[DispatchRow],
    together: list[DispatchRow],
    allowed: frozenset[str],
    one_side: frozenset[str],
    hints: set[str],
) -> tuple[tuple[DispatchRow | None, DispatchRow | None] | None, list[str]]:
    by_slot_a: dict[tuple[str, str | None], list[DispatchRow]] = {}
    by_slot_t: dict[tuple[str, str | None], list[DispatchRow]] = {}
    for r in alone:
        by_slot_a.setdefault(r.slot, []).append(r)
    for r in together:
        by_slot_t.setdefault(r.slot, []).append(r)
    slots = sorted(set(by_slot_a) | set(by_slot_t), key=_slot_order)
    problems: list[str] = []
    first = None
    for slot in slots:
        a, t = by_slot_a.get(slot, []), by_slot_t.get(slot, [])
        where = slot[0] if slot[1] is None else f"{slot[0]} [group {slot[1]!r}]"
        if not a or not t:
            if slot[0] in one_side:
                continue
            side = "together" if not a else "alone"
            calls = sum(r.calls for r in (a or t))
            problems.append(
                f"{where} ran only {side} ({calls} calls; none {'alone' if not a else 'together'}"
                f"): pass allow_one_side={slot[0]!r} if only one workload runs it on purpose"
            )
            if first is None:
                first = (a[0] if a else None, t[0] if t else None)
            continue
        keys_a = {r.ran: r for r in a}
        keys_t = {r.ran: r for r in t}
        only_a = [keys_a[k] for k in sorted(keys_a.keys() - keys_t.keys(), key=_key_order)]
        only_t = [keys_t[k] for k in sorted(keys_t.keys() - keys_a.keys(), key=_key_order)]
        if only_a or only_t:
            ra = only_a[0] if only_a else None
            rt = only_t[0] if only_t else None
            problems.append(f"{where}: {_what_differs(ra, rt, hints)}")
            if first is None:
                first = (ra, rt)
            continue
        if slot[0] in allowed:
            continue
        for k in sorted(keys_a, key=_key_order):
            ra, rt = keys_a[k], keys_t[k]
            if ra.calls != rt.calls:
                if rt.calls > ra.calls:
                    hints.add("more")
                problems.append(
                    f"{where}: the same dispatch, but {ra.calls} calls alone and {rt.calls} "
                    f"together (pass allow_call_count_diff={slot[0]!r} if the workloads run "
                    "different numbers of steps on purpose)"
                )
                if first is None:
                    first = (ra, rt)
    return first, problems


def _slot_order(slot: tuple[str, str | None]) -> tuple[int, str]:
    return (Phase.parse(slot[0]).value, slot[1] or "")


def _key_order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple("" if v is None else v for v in key)


HINTS = {
    "backend": (
        "a backend differs: the runner's kernel changed because other runners exist. "
        "Something they did (their start-up, a setting they wrote that this runner reads "
        "later) reached this runner's dispatch; the runner should own its BackendSpec, "
        "chosen once at its own start-up from its own settings."
    ),
    "form": (
        "an attention form differs: the form policy saw other metadata (is a batch or plan "
        "shared with another runner?)."
    ),
    "config": (
        "a bound config differs: the runner was bound to another shape with other runners "
        "alive (a config or setting shared with, copied from or overwritten by another "
        "runner); build each runner's AttnConfig from its own model."
    ),
    "impl": (
        "the same backend name ran another implementation: a registry entry replaced under "
        "that name (register_backend(..., replace=True) by another runner's start-up), or "
        "other factory options, reached this runner's binding; bind each runner from its own "
        "settings, against a registry no other runner rewrites."
    ),
    "more": (
        "more calls together than alone for the same work: another runner's layers may have "
        "run under this runner's scope (its binding, batch or metadata reused by another "
        "runner)."
    ),
}


def _what_differs(a: DispatchRow | None, t: DispatchRow | None, hints: set[str]) -> str:
    if a is None or t is None:
        row = a or t
        assert row is not None
        side = "alone" if a is not None else "together"
        return f"an extra dispatch {side} only: {row.describe(calls=False)}"
    parts = []
    if a.backend != t.backend:
        parts.append(f"backend {a.backend!r} alone but {t.backend!r} together")
        hints.add("backend")
    if a.backend == t.backend and a.impl != t.impl:
        parts.append(f"backend {a.backend!r} ran {a.impl} alone but {t.impl} together")
        hints.add("impl")
    if a.form != t.form:
        parts.append(f"attention form {a.form or '-'} alone but {t.form or '-'} together")
        hints.add("form")
    if a.config != t.config:
        changes = "; ".join(config_changes(a.bound, t.bound)) or "fields not recorded"
        parts.append(f"bound config {a.config} alone but {t.config} together ({changes})")
        hints.add("config")
    return "; ".join(parts) or "rows differ"


def _message(
    label: str,
    checked: bool,
    problems: list[str],
    hints: list[str],
    first: tuple[DispatchRow | None, DispatchRow | None] | None,
    mine: tuple[list[DispatchRow], list[DispatchRow]],
    others: tuple[tuple[str | None, ...], tuple[str | None, ...]],
    together_rows: tuple[DispatchRow, ...],
    allowed: frozenset[str],
    one_side: frozenset[str],
) -> str:
    mine_a, mine_t = mine
    others_a, others_t = others
    lines = [
        f"runner {label!r} is not isolated: it dispatched differently with other runners alive"
        if checked
        else f"runner {label!r} cannot be checked for isolation: it made no attention calls"
    ]
    if first is not None:
        ra, rt = first
        lines.append(f"  first difference, alone:    {ra.describe() if ra else '(no such row)'}")
        lines.append(f"  first difference, together: {rt.describe() if rt else '(no such row)'}")
    lines.append("  what differs:")
    lines.extend(f"    - {p}" for p in problems)
    if hints:
        lines.append("  likely cause:")
        lines.extend(f"    - {HINTS[h]}" for h in hints)
    alive = _names(others_t) or "none"
    lines.append(f"  other runners alive together: {alive}")
    if others_a:
        lines.append(
            f"  (runners that also dispatched in the 'alone' workload: {_names(others_a)})"
        )
    if allowed:
        lines.append(f"  call counts allowed to differ in: {', '.join(sorted(allowed))}")
    if one_side:
        lines.append(f"  allowed to run on one side only: {', '.join(sorted(one_side))}")
    lines.append(f"  rows of {label!r} alone:")
    lines.append(format_rows(mine_a, indent="    "))
    lines.append(f"  rows of {label!r} together:")
    lines.append(format_rows(mine_t, indent="    "))
    other_rows = [r for r in together_rows if r.runner != label]
    if other_rows:
        lines.append("  rows of the other runners together:")
        lines.append(format_rows(other_rows, indent="    "))
    return "\n".join(lines)
