"""Dispatch rows: what each runner's attention calls ran, aggregated, and fingerprints of them.

A row is one (runner, phase, layer group, backend, attention form, bound config) with its call
count. Rows say *what* a runner dispatched to, never *when*: two workloads that make the same
choices give the same rows whatever the interleaving of their runners. No torch, no hypothesis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._phase import Phase
from attn_dispatch._record import DispatchRecorder
from attn_dispatch._record import record_dispatch

#: Version of the canonical form hashed by the fingerprints: bumped if it ever changes, so a
#: stored fingerprint is never compared with one of another form.
FINGERPRINT_VERSION = 1


def _canonical(data: Any) -> bytes:
    # Sorted keys, no whitespace, ASCII only: the same bytes in every process and Python.
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_fingerprint(config: AttnConfig | None) -> str:
    """16 hex digits of the sha256 of the config's canonical JSON (``"-"`` for no config).

    Every field takes part (dims, dtypes, page size, variants, scale): two runners bound to
    configs with the same fingerprint have attention layers of the same shape.

    >>> from attn_dispatch import AttnConfig
    >>> config_fingerprint(AttnConfig("mha", 8, 2, 64, dtype="float32"))
    'b09d2d8493043457'
    """
    if config is None:
        return "-"
    payload = {"v": FINGERPRINT_VERSION, "config": config.to_dict()}
    return hashlib.sha256(_canonical(payload)).hexdigest()[:16]


def describe_config(config: AttnConfig | None) -> str:
    """A short description of a config for messages: ``mha 8q/2kv d64 float32 page 16``."""
    if config is None:
        return "no config recorded"
    dims = f"d{config.head_dim}" + (
        f"/{config.v_head_dim}" if config.v_head_dim != config.head_dim else ""
    )
    parts = [config.kind, f"{config.num_q_heads}q/{config.num_kv_heads}kv", dims, config.dtype]
    if config.kv_dtype != config.dtype:
        parts.append(f"kv {config.kv_dtype}")
    parts.append(f"page {config.page_size}")
    parts.extend(sorted(config.variants))
    if config.tree_verify:
        parts.append("tree")
    return " ".join(parts)


def config_changes(a: AttnConfig | None, b: AttnConfig | None) -> list[str]:
    """The fields where two configs differ, as ``"head_dim: 576 -> 64"``."""
    if a is None or b is None:
        return [] if a is b else ["config: recorded on one side only"]
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} -> {db[k]!r}" for k in da if da[k] != db[k]]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class DispatchRow:
    """What one runner dispatched in one (phase, group), and how many calls did.

    ``config`` is the fingerprint of the bound ``AttnConfig`` (``config_fingerprint``);
    ``bound`` is the config itself (not compared; for messages)."""

    runner: str | None
    phase: str
    group: str | None
    backend: str
    form: str | None
    config: str
    calls: int = dataclasses.field(compare=False)
    bound: AttnConfig | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str | None, str, str | None, str]:
        """What the row says was dispatched: (phase, group, backend, form, config)."""
        return (self.phase, self.group, self.backend, self.form, self.config)

    @property
    def slot(self) -> tuple[str, str | None]:
        """Where the choice was made: (phase, group)."""
        return (self.phase, self.group)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "phase": self.phase,
            "group": self.group,
            "backend": self.backend,
            "form": self.form,
            "config": self.config,
            "calls": self.calls,
        }

    def describe(self, *, calls: bool = True) -> str:
        """One line: ``decode backend 'triton' form - config 1a2b.. (mha 8q/2kv ..) x24``."""
        where = self.phase if self.group is None else f"{self.phase} [group {self.group!r}]"
        text = (
            f"{where}: backend {self.backend!r}, form {self.form or '-'}, config {self.config} "
            f"({describe_config(self.bound)})"
        )
        return f"{text}, {self.calls} calls" if calls else text


def rows_from_tally(recorder: DispatchRecorder) -> list[DispatchRow]:
    """The rows of a ``record_dispatch(tally=True)`` recorder (events it holds count too)."""
    sums: dict[tuple[str | None, str, str | None, str, str | None, str], list[Any]] = {}
    for (binding, phase, form, group), calls in recorder.tally().items():
        config = binding._config
        key = (
            binding.label,
            phase.name.lower(),
            group,
            binding.spec.names[phase],
            None if form is None else form.value,
            config_fingerprint(config),
        )
        entry = sums.setdefault(key, [0, config])
        entry[0] += calls
    for e in recorder.events:  # record_events (a CUDA-graph replay): no binding to read
        key = (e.label, e.phase.name.lower(), e.group, e.backend, e.form, "-")
        sums.setdefault(key, [0, None])[0] += 1
    return sorted(
        (
            DispatchRow(r, p, g, b, f, c, calls=calls, bound=config)
            for (r, p, g, b, f, c), (calls, config) in sums.items()
        ),
        key=row_order,
    )


def row_order(row: DispatchRow) -> tuple[Any, ...]:
    """Runners by label (unlabelled last), then phases in serving order (prefill, decode,
    verify), then group, backend, form, config."""
    return (
        row.runner is None,
        row.runner or "",
        Phase.parse(row.phase).value,
        row.group or "",
        row.backend,
        row.form or "",
        row.config,
    )


class RowRecorder:
    """What ``record_rows`` yields: the rows of the calls made while it was open."""

    __slots__ = ("_recorder",)

    def __init__(self, recorder: DispatchRecorder) -> None:
        self._recorder = recorder

    def rows(self) -> list[DispatchRow]:
        """Every row, sorted."""
        return rows_from_tally(self._recorder)

    def rows_of(self, runner: str | None) -> list[DispatchRow]:
        """The rows of ``runner`` (its label; None: unlabelled bindings)."""
        return [r for r in self.rows() if r.runner == runner]

    def runners(self) -> list[str | None]:
        """The labels of the runners that made attention calls (sorted, None last)."""
        labels = {r.runner for r in self.rows()}
        return sorted(labels, key=lambda x: (x is None, x or ""))

    def ledger(self, runner: str | None) -> Ledger:
        """The ledger of ``runner``'s rows (see ``Ledger``)."""
        return Ledger.of(runner, self.rows())

    def table(self) -> str:
        """Every row as an aligned text table."""
        return format_rows(self.rows())


@contextlib.contextmanager
def record_rows() -> Iterator[RowRecorder]:
    """Record dispatch rows of every ``attention`` call in this context (threads and tasks
    that inherit it included, as for ``record_dispatch``); cheap: a tally per call.

    .. code-block:: python

        with record_rows() as rec:
            run_forward()
        rec.rows_of("target")
    """
    with record_dispatch(tally=True) as recorder:
        yield RowRecorder(recorder)


def format_rows(rows: Iterable[DispatchRow], indent: str = "") -> str:
    """Rows as a text table (runner, phase, group, backend, form, config, calls)."""
    body = [
        (
            str(r.runner),
            r.phase,
            r.group or "-",
            r.backend,
            r.form or "-",
            f"{r.config} ({describe_config(r.bound)})",
            str(r.calls),
        )
        for r in rows
    ]
    if not body:
        return f"{indent}(no attention calls)"
    header = ("runner", "phase", "group", "backend", "form", "config", "calls")
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    ]
    return "\n".join(indent + line for line in lines)


@dataclasses.dataclass(frozen=True, slots=True)
class Ledger:
    """One runner's dispatch choices, without counts or order: what it dispatched to, not when.

    ``entries`` are the sorted ``(phase, group, backend, form, config fingerprint)`` of its
    rows; ``fingerprint`` is 16 hex digits of the sha256 of their canonical JSON (with the
    runner's label), the same in every run and process for the same choices. Store
    ``to_json()`` in a repository and compare in CI: ``Ledger.from_json(old).diff(new)``.
    """

    runner: str | None
    entries: tuple[tuple[str, str | None, str, str | None, str], ...]

    @classmethod
    def of(cls, runner: str | None, rows: Iterable[DispatchRow]) -> Ledger:
        """The ledger of ``runner`` from rows (rows of other runners are left out)."""
        return cls(runner, tuple(sorted({r.key for r in rows if r.runner == runner}, key=_order)))

    @property
    def fingerprint(self) -> str:
        payload = {
            "v": FINGERPRINT_VERSION,
            "runner": self.runner,
            "entries": [list(e) for e in self.entries],
        }
        return hashlib.sha256(_canonical(payload)).hexdigest()[:16]

    def to_json(self) -> str:
        """Canonical JSON (stable bytes): runner, entries, fingerprint."""
        return _canonical(
            {
                "v": FINGERPRINT_VERSION,
                "runner": self.runner,
                "entries": [list(e) for e in self.entries],
                "fingerprint": self.fingerprint,
            }
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        data = json.loads(text)
        if data.get("v") != FINGERPRINT_VERSION:
            raise ValueError(
                f"ledger format version {data.get('v')!r} is not {FINGERPRINT_VERSION!r}: "
                "record the ledger again with this attn_dispatch"
            )
        return cls(data["runner"], tuple(tuple(e) for e in data["entries"]))

    def diff(self, other: Ledger) -> list[str]:
        """Entries only in this ledger (``-``) and only in ``other`` (``+``), one per line."""
        mine, theirs = set(self.entries), set(other.entries)
        out = [f"- {_entry_text(e)}" for e in sorted(mine - theirs, key=_order)]
        out += [f"+ {_entry_text(e)}" for e in sorted(theirs - mine, key=_order)]
        return out


def _order(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    # None sorts before every string (entries mix them in the group and form columns).
    return tuple(("", "") if v is None else (" ", v) for v in entry)


def _entry_text(e: tuple[str, str | None, str, str | None, str]) -> str:
    phase, group, backend, form, config = e
    where = phase if group is None else f"{phase} [group {group!r}]"
    return f"{where}: backend {backend!r}, form {form or '-'}, config {config}"


def ledgers(rows: Iterable[DispatchRow]) -> Mapping[str | None, Ledger]:
    """One ledger per runner in ``rows``."""
    rows = list(rows)
    return {label: Ledger.of(label, rows) for label in {r.runner for r in rows}}


def phase_name(phase: Phase | str) -> str:
    """``"decode"`` for ``Phase.DECODE`` or ``"DECODE"``/``"decode"``."""
    return Phase.parse(phase).name.lower()
