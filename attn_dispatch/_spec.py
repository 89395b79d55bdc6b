"""BackendSpec: the kernel names one runner uses, per phase.

A framework's own way of naming them (SGLang's server arguments) is read by its integration:
``attn_dispatch.integrations.sglang.spec_from_server_args``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any
from typing import Literal

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._vocab import VERIFY_MODES as _VERIFY_MODES
from attn_dispatch._vocab import VerifyMode

_KEYS = ("prefill", "decode", "verify", "verify_mode")
_DICT_KEYS = (*_KEYS, "buckets", "note")
_PHASE_KEYS = ("prefill", "decode", "verify")

#: What a shape bucket bounds: the longest query (``q_len``: the batch's ``max_q_len``) or
#: the longest context, new tokens included (``context``: its ``max_kv_len``).
Measure = Literal["q_len", "context"]
MEASURES: tuple[Measure, ...] = ("q_len", "context")
#: The batch attribute each measure reads, once per forward at scope entry.
MEASURE_ATTRS = {"q_len": "max_q_len", "context": "max_kv_len"}


def _check_name(field: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidSpecError(field, value, "must be a non-empty backend name")
    value = value.strip()
    if any(c in value for c in ",=| \t"):
        raise InvalidSpecError(
            field, value, "a backend name cannot contain ',', '=', '|' or spaces"
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """Shape buckets of one phase: a backend per range of one measure of the batch.

    ``limits`` is ``((upper bound, backend), ...)`` with strictly increasing bounds; a batch
    whose measure is at most a bound runs that bound's backend (the first that fits), and a
    batch past the last bound runs the phase's own backend in the spec (the catch-all).

    >>> spec = BackendSpec.parse("prefill=q_len<=256:native|sdpa,decode=native")
    >>> spec.buckets_for(Phase.PREFILL)
    Buckets(phase='prefill', measure='q_len', limits=((256, 'native'),))
    >>> spec.backend_at(Phase.PREFILL, 100), spec.backend_at(Phase.PREFILL, 1000)
    ('native', 'sdpa')

    The bucket is chosen once per forward, when ``attn_scope`` opens with the batch (the
    longest query or context in it); every layer then calls that bucket's backend.
    """

    phase: str
    measure: Measure
    limits: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        where = f"buckets[{self.phase!r}]"
        if self.phase not in _PHASE_KEYS:
            raise InvalidSpecError(
                "buckets", self.phase, f"unknown phase; phases are {list(_PHASE_KEYS)!r}"
            )
        if self.measure not in MEASURES:
            raise InvalidSpecError(
                f"{where}.measure", self.measure, f"choose one of {list(MEASURES)!r}"
            )
        if not isinstance(self.limits, (tuple, list)) or not self.limits:
            raise InvalidSpecError(
                f"{where}.limits",
                self.limits,
                "expected at least one (upper bound, backend) pair before the catch-all",
            )
        limits: list[tuple[int, str]] = []
        for item in self.limits:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise InvalidSpecError(
                    f"{where}.limits", item, "each bucket is an (upper bound, backend) pair"
                )
            bound, name = item
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
                raise InvalidSpecError(f"{where}.limits", bound, "a bound must be an int >= 1")
            limits.append((bound, _check_name(f"{where}.limits", name)))
        bounds = [b for b, _ in limits]
        for lo, hi in itertools.pairwise(bounds):
            if hi <= lo:
                problem = "overlaps the one before it" if hi == lo else "is out of order"
                raise InvalidSpecError(
                    f"{where}.limits",
                    bounds,
                    f"bound {hi} {problem}: bounds must strictly increase "
                    f"({self.measure}<=a:x|{self.measure}<=b:y|z with a < b)",
                )
        object.__setattr__(self, "limits", tuple(limits))

    @classmethod
    def parse(cls, phase: str, text: str) -> tuple[Buckets, str]:
        """``("prefill", "q_len<=256:native|sdpa")`` -> ``(Buckets, catch-all name)``."""
        where = f"buckets[{phase!r}]"
        parts = [p.strip() for p in text.split("|")]
        if len(parts) < 2 or not all(parts):
            raise InvalidSpecError(
                where,
                text,
                "write buckets as 'q_len<=256:native|sdpa': one or more MEASURE<=BOUND:BACKEND, "
                "then the catch-all backend, separated by '|'",
            )
        *bucketed, rest = parts
        measure: str | None = None
        limits: list[tuple[int, str]] = []
        for part in bucketed:
            cond, colon, name = part.partition(":")
            key, le, bound = cond.partition("<=")
            key = key.strip()
            if not colon or not le or key not in MEASURES:
                raise InvalidSpecError(
                    where,
                    part,
                    f"expected MEASURE<=BOUND:BACKEND with MEASURE one of {list(MEASURES)!r}, "
                    "e.g. 'q_len<=256:native'",
                )
            if measure is not None and key != measure:
                raise InvalidSpecError(
                    where, text, f"one measure per phase: {measure!r} and {key!r} both given"
                )
            measure = key
            try:
                value = int(bound.strip())
            except ValueError:
                raise InvalidSpecError(where, part, "the bound must be an integer") from None
            limits.append((value, name.strip()))
        if "<=" in rest:
            raise InvalidSpecError(
                where, text, "the last item is the catch-all: a bare backend name, no bound"
            )
        return cls(phase, measure, tuple(limits)), _check_name(where, rest)  # type: ignore[arg-type]

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(b for b, _ in self.limits)

    @property
    def names(self) -> tuple[str, ...]:
        """The bucketed backends, in bound order (the catch-all is the spec's)."""
        return tuple(n for _, n in self.limits)

    def index(self, value: int) -> int:
        """The bucket ``value`` falls in: ``len(limits)`` for the catch-all."""
        for i, (bound, _) in enumerate(self.limits):
            if value <= bound:
                return i
        return len(self.limits)

    def text(self, rest: str) -> str:
        """The spec-string form, with ``rest`` as the catch-all."""
        head = "|".join(f"{self.measure}<={b}:{n}" for b, n in self.limits)
        return f"{head}|{rest}"

    def to_dict(self) -> dict[str, Any]:
        return {"measure": self.measure, "limits": [[b, n] for b, n in self.limits]}


@dataclasses.dataclass(frozen=True, slots=True)
class BackendSpec:
    """The backend name of each phase of one runner. Immutable, hashable, picklable.

    >>> spec = BackendSpec.parse("prefill=triton,decode=flashinfer")
    >>> spec.backend_for(Phase.VERIFY)  # verify=None follows verify_mode ("prefill")
    'triton'
    >>> BackendSpec.parse(str(spec)) == spec
    True

    A phase may name shape buckets (``Buckets``) instead of one backend: the field then holds
    the catch-all and ``buckets`` the bounded ones.

    >>> spec = BackendSpec.parse("prefill=q_len<=256:native|sdpa,decode=native")
    >>> spec.prefill, str(spec) == "prefill=q_len<=256:native|sdpa,decode=native"
    ('sdpa', True)
    """

    prefill: str
    decode: str
    verify: str | None = None
    verify_mode: VerifyMode = "prefill"
    #: Shape buckets, at most one ``Buckets`` per phase (in phase order); ``()``: none.
    buckets: tuple[Buckets, ...] = ()
    # Where the names came from (e.g. a rename SGLang applied); provenance, not identity.
    note: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        for field in _PHASE_KEYS:
            value = getattr(self, field)
            if value is None and field == "verify":
                continue
            object.__setattr__(self, field, _check_name(field, value))
        if self.note is not None and not isinstance(self.note, str):
            raise InvalidSpecError("note", self.note, "must be a string or None")
        if self.verify_mode not in _VERIFY_MODES:
            raise InvalidSpecError(
                "verify_mode", self.verify_mode, "choose 'prefill' (default) or 'decode'"
            )
        buckets = self.buckets
        if isinstance(buckets, Mapping):
            buckets = tuple(_buckets_from(k, v) for k, v in buckets.items())
        if not isinstance(buckets, (tuple, list)) or not all(
            isinstance(b, Buckets) for b in buckets
        ):
            raise InvalidSpecError(
                "buckets", self.buckets, "expected Buckets values (at most one per phase)"
            )
        phases = [b.phase for b in buckets]
        twice = sorted({p for p in phases if phases.count(p) > 1})
        if twice:
            raise InvalidSpecError("buckets", twice, "one Buckets per phase")
        if "verify" in phases and self.verify is None:
            raise InvalidSpecError(
                "buckets",
                "verify",
                "verify buckets need a verify catch-all: 'verify=q_len<=4:native|sdpa' "
                "(verify=None follows the verify_mode phase, buckets included)",
            )
        order = {p: i for i, p in enumerate(_PHASE_KEYS)}
        object.__setattr__(self, "buckets", tuple(sorted(buckets, key=lambda b: order[b.phase])))

    @classmethod
    def uniform(cls, name: str) -> BackendSpec:
        """The same backend for every phase: ``BackendSpec.uniform("torch")``."""
        return cls(prefill=name, decode=name)

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """Parse ``"prefill=a,decode=b[,verify=c][,verify_mode=decode]"``.

        A bare name is the default for prefill and decode: ``"triton,decode=flashinfer"``.
        A phase's value may be shape buckets, ``"prefill=q_len<=256:native|sdpa"``: one or more
        ``MEASURE<=BOUND:BACKEND`` (``q_len`` or ``context``, bounds increasing), then the
        catch-all backend.
        """
        if not isinstance(text, str):
            raise InvalidSpecError("spec", text, "expected a string such as 'prefill=a,decode=b'")
        fields: dict[str, str] = {}
        default: str | None = None
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                raise InvalidSpecError("spec", text, "empty item; write 'prefill=a,decode=b'")
            if "=" not in item:
                if default is not None:
                    raise InvalidSpecError("spec", text, "more than one bare backend name")
                default = item
                continue
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in _KEYS:
                raise InvalidSpecError(
                    "spec", text, f"unknown key {key!r}; keys are {', '.join(map(repr, _KEYS))}"
                )
            if key in fields:
                raise InvalidSpecError("spec", text, f"key {key!r} given twice")
            fields[key] = value
        buckets: list[Buckets] = []
        for key in _PHASE_KEYS:
            given = fields.get(key)
            if given is not None and "|" in given:
                found, fields[key] = Buckets.parse(key, given)
                buckets.append(found)
        prefill = fields.pop("prefill", default)
        decode = fields.pop("decode", default)
        if prefill is None or decode is None:
            missing = "prefill" if prefill is None else "decode"
            raise InvalidSpecError(
                "spec",
                text,
                f"no backend for {missing}; give {missing}=NAME or a bare default name",
            )
        return cls(
            prefill=prefill,
            decode=decode,
            verify=fields.get("verify"),
            verify_mode=fields.get("verify_mode", "prefill"),  # type: ignore[arg-type]
            buckets=tuple(buckets),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendSpec:
        unknown = set(data) - set(_DICT_KEYS)
        if unknown:
            raise InvalidSpecError(
                "spec",
                dict(data),
                f"unknown keys {sorted(unknown)!r}; keys are {list(_DICT_KEYS)!r}",
            )
        fields = dict(data)
        raw = fields.pop("buckets", None) or {}
        if not isinstance(raw, Mapping):
            raise InvalidSpecError(
                "buckets", raw, "expected phase -> {'measure': ..., 'limits': [[bound, name]]}"
            )
        try:
            return cls(**fields, buckets=tuple(_buckets_from(k, v) for k, v in raw.items()))
        except TypeError as exc:
            raise InvalidSpecError("spec", dict(data), str(exc)) from None

    @classmethod
    def from_json(cls, text: str) -> BackendSpec:
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidSpecError("spec", text, f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidSpecError("spec", text, "expected a JSON object")
        return cls.from_dict(data)

    def backend_for(self, phase: Phase) -> str:
        """The backend name that serves ``phase`` (its catch-all, for a bucketed phase)."""
        if phase is Phase.PREFILL:
            return self.prefill
        if phase is Phase.DECODE:
            return self.decode
        if self.verify is not None:
            return self.verify
        return self.prefill if self.verify_mode == "prefill" else self.decode

    def buckets_for(self, phase: Phase) -> Buckets | None:
        """The shape buckets of ``phase`` (verify=None follows its verify_mode phase's)."""
        if not self.buckets:
            return None
        key = phase.name.lower()
        if phase is Phase.VERIFY and self.verify is None:
            key = self.verify_mode
        for b in self.buckets:
            if b.phase == key:
                return b
        return None

    def backend_at(self, phase: Phase, value: int) -> str:
        """The backend that serves ``phase`` for a batch whose bucket measure is ``value``."""
        b = self.buckets_for(phase)
        if b is None:
            return self.backend_for(phase)
        i = b.index(value)
        return b.limits[i][1] if i < len(b.limits) else self.backend_for(phase)

    def bucket_spec(self, phase: Phase, index: int) -> BackendSpec:
        """The plain spec (no buckets) that serves bucket ``index`` of ``phase`` (the last
        index, ``len(limits)``, is the catch-all): what one forward in that bucket binds."""
        b = self.buckets_for(phase)
        name = self.backend_for(phase)
        where = "catch-all"
        if b is not None and index < len(b.limits):
            bound, name = b.limits[index]
            where = f"{b.measure}<={bound}"
        names = {p: (name if p is phase else self.backend_for(p)) for p in Phase}
        return BackendSpec(
            prefill=names[Phase.PREFILL],
            decode=names[Phase.DECODE],
            verify=names[Phase.VERIFY],
            note=f"bucket {phase.name.lower()} {where} of {self}",
        )

    @property
    def names(self) -> tuple[str, str, str]:
        """Backend names indexed by ``Phase`` (each phase's catch-all)."""
        return (self.prefill, self.decode, self.backend_for(Phase.VERIFY))

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every backend the spec names, buckets included, each once (first use first)."""
        seen: dict[str, None] = dict.fromkeys(self.names)
        for b in self.buckets:
            seen.update(dict.fromkeys(b.names))
        return tuple(seen)

    def phase_text(self, phase: Phase) -> str:
        """How ``phase`` is served, as a spec string writes it (``q_len<=256:native|sdpa``)."""
        b = self.buckets_for(phase)
        name = self.backend_for(phase)
        return name if b is None else b.text(name)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``buckets`` and ``note`` only when there are some."""
        data: dict[str, Any] = {
            "prefill": self.prefill,
            "decode": self.decode,
            "verify": self.verify,
            "verify_mode": self.verify_mode,
        }
        if self.buckets:
            data["buckets"] = {b.phase: b.to_dict() for b in self.buckets}
        if self.note is not None:
            data["note"] = self.note
        return data

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), sort_keys=True)

    def __str__(self) -> str:
        if (
            self.prefill == self.decode
            and self.verify is None
            and self.verify_mode == "prefill"
            and not self.buckets
        ):
            return self.prefill
        own = {b.phase: b for b in self.buckets}

        def text(key: str, name: str) -> str:
            return own[key].text(name) if key in own else name

        out = f"prefill={text('prefill', self.prefill)},decode={text('decode', self.decode)}"
        if self.verify is not None:
            out += f",verify={text('verify', self.verify)}"
        if self.verify_mode != "prefill":
            out += f",verify_mode={self.verify_mode}"
        return out


def _buckets_from(phase: object, value: object) -> Buckets:
    if isinstance(value, Buckets):
        if value.phase != phase:
            raise InvalidSpecError("buckets", phase, f"holds the buckets of {value.phase!r}")
        return value
    if (
        not isinstance(phase, str)
        or not isinstance(value, Mapping)
        or set(value)
        != {
            "measure",
            "limits",
        }
    ):
        raise InvalidSpecError(
            f"buckets[{phase!r}]",
            value,
            "expected {'measure': 'q_len' or 'context', 'limits': [[bound, backend], ...]}",
        )
    limits = value["limits"]
    if not isinstance(limits, (list, tuple)):
        raise InvalidSpecError(f"buckets[{phase!r}].limits", limits, "expected a list of pairs")
    return Buckets(
        phase, value["measure"], tuple(tuple(x) if isinstance(x, list) else x for x in limits)
    )
