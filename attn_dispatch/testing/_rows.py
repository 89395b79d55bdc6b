"""Dispatch rows: what each runner's attention calls ran, aggregated, and fingerprints of them.

A row is one (runner, phase, layer group, backend, attention form, bound config) with its call
count. Rows say *what* a runner dispatched to, never *when*: two workloads that make the same
choices give the same rows whatever the interleaving of their runners. No torch, no hypothesis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidSpecError
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
    #: What ran under the name ``backend`` (``implementation_of``): the backend object's
    #: class, its build and the options that change its kernel path ("" if not recorded).
    impl: str = ""

    @property
    def ran(self) -> tuple[str, str | None, str, str | None, str, str]:
        """What the row says ran: ``key`` and the implementation behind the name."""
        return (*self.key, self.impl)

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
            "impl": self.impl,
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
    sums: dict[tuple[str | None, str, str | None, str, str | None, str, str], list[Any]] = {}
    for (binding, phase, form, group), calls in recorder.tally().items():
        config = binding._config
        key = (
            binding.label,
            phase.name.lower(),
            group,
            binding.spec.names[phase],
            None if form is None else form.value,
            config_fingerprint(config),
            _ran(binding, phase, form),
        )
        entry = sums.setdefault(key, [0, config])
        entry[0] += calls
    for e in recorder.events:  # record_events (a CUDA-graph replay): no binding to read
        key = (e.label, e.phase.name.lower(), e.group, e.backend, e.form, "-", "")
        sums.setdefault(key, [0, None])[0] += 1
    return sorted(
        (
            DispatchRow(r, p, g, b, f, c, calls=calls, bound=config, impl=i)
            for (r, p, g, b, f, c, i), (calls, config) in sums.items()
        ),
        key=row_order,
    )


# Instance attributes that say nothing about the kernel path (the config has its own column).
_NOT_OPTIONS = frozenset({"self", "name", "config"})
_SCALARS = (bool, int, float, str, type(None))


def kernel_options(backend: object) -> dict[str, Any]:
    """The options of a backend object that change its kernel path, as recorded in a row.

    A backend may say it itself with a ``kernel_options`` mapping (or a method returning
    one). Otherwise they are the factory's keyword options as the object keeps them: each
    keyword parameter of its class's ``__init__`` (``num_threads``, ``validate``, ``extend``)
    that the object holds under the same name as a plain value (bool, number, string, None),
    and its build (``abi_version``) if it has one. Other attributes (counters, caches) are not
    options and never make two rows differ.
    """
    if getattr(type(backend), "kernel_options", None) is not None:
        got = backend.kernel_options  # type: ignore[attr-defined]
        got = got() if callable(got) else got
        return {str(k): v for k, v in dict(got).items()}
    try:
        params = inspect.signature(type(backend).__init__).parameters.values()
    except (TypeError, ValueError):  # a builtin or C-implemented __init__: nothing to read
        params = ()  # type: ignore[assignment]
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out: dict[str, Any] = {}
    for p in params:
        if p.kind not in keywords or p.name in _NOT_OPTIONS or p.name.startswith("_"):
            continue
        value = getattr(backend, p.name, _ABSENT)
        if value is not _ABSENT and isinstance(value, _SCALARS):
            out[p.name] = value
    build = getattr(backend, "abi_version", None)
    if isinstance(build, _SCALARS) and build is not None:
        out["abi_version"] = build
    return dict(sorted(out.items()))


_ABSENT = object()


def implementation_of(backend: object) -> str:
    """``module.Class(option=value, ...)``: what ran, for rows and messages (the same text in
    every process for the same code and options)."""
    if backend is None:
        return "-"
    klass = type(backend)
    opts = ", ".join(f"{k}={v!r}" for k, v in kernel_options(backend).items())
    return f"{klass.__module__}.{klass.__qualname__}({opts})"


def _ran(binding: Any, phase: Phase, form: Any) -> str:
    """The implementation that served ``phase`` (in ``form``) for ``binding``: the backend
    object of its route, or of the decompressed form it took."""
    route = binding._routes[phase]
    backend = route.backend
    if form is not None and form in route.forms:
        backend = route.forms[form][0]  # None: MHA_CHUNKED, planned from the batch itself
    return implementation_of(backend)


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
    def from_json(cls, text: str | bytes) -> Ledger:
        """The ledger ``to_json`` wrote. Text that is not one (not JSON, another format
        version, a field missing or of the wrong type, a fingerprint that does not match the
        entries: edited by hand) raises ``InvalidSpecError`` saying which."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise InvalidSpecError("ledger", text, "pass the text Ledger.to_json() wrote")
        shown = text if len(text) <= 200 else text[:200]
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InvalidSpecError("ledger", shown, f"is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InvalidSpecError(
                "ledger", shown, f"is JSON {type(data).__name__}, not a ledger object"
            )
        if data.get("v") != FINGERPRINT_VERSION:
            raise InvalidSpecError(
                "ledger",
                shown,
                f"ledger format version {data.get('v')!r} is not {FINGERPRINT_VERSION!r}: "
                "record the ledger again with this attn_dispatch",
            )
        missing = [k for k in ("runner", "entries") if k not in data]
        if missing:
            raise InvalidSpecError("ledger", shown, f"lacks {', '.join(missing)}")
        runner, entries = data["runner"], data["entries"]
        if runner is not None and not isinstance(runner, str):
            raise InvalidSpecError("ledger.runner", runner, "must be a string or null")
        if not isinstance(entries, list):
            raise InvalidSpecError("ledger.entries", entries, "must be a list of entries")
        ledger = cls(runner, tuple(_entry(e, i) for i, e in enumerate(entries)))
        stored = data.get("fingerprint")
        if stored is not None and stored != ledger.fingerprint:
            raise InvalidSpecError(
                "ledger.fingerprint",
                stored,
                f"does not match its entries ({ledger.fingerprint}): the ledger was edited; "
                "record it again",
            )
        return ledger

    def diff(self, other: Ledger) -> list[str]:
        """Entries only in this ledger (``-``) and only in ``other`` (``+``), one per line."""
        mine, theirs = set(self.entries), set(other.entries)
        out = [f"- {_entry_text(e)}" for e in sorted(mine - theirs, key=_order)]
        out += [f"+ {_entry_text(e)}" for e in sorted(theirs - mine, key=_order)]
        return out


def _entry(e: object, i: int) -> tuple[str, str | None, str, str | None, str]:
    """One ledger entry read back: ``[phase, group, backend, form, config]``."""
    ok = (
        isinstance(e, list)
        and len(e) == 5
        and all(isinstance(e[k], str) for k in (0, 2, 4))
        and all(e[k] is None or isinstance(e[k], str) for k in (1, 3))
    )
    if not ok:
        raise InvalidSpecError(
            f"ledger.entries[{i}]",
            e,
            "must be [phase, group or null, backend, form or null, config fingerprint]",
        )
    assert isinstance(e, list)
    phase_name(e[0])  # an unknown phase raises UnknownPhaseError
    return (e[0], e[1], e[2], e[3], e[4])


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
