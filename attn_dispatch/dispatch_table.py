"""Dispatch tables: ``tune``'s measurements saved with the environment they hold for, replayed.

``python -m attn_dispatch tune --save FILE`` (or ``tune_table(...).save(FILE)``) writes, per
runner label, layer group and phase, the winner and the runner-up with their times and the
shape they were measured at, and the environment: the library and torch versions, the device
(CPU model or GPU name), torch's thread count and each timed backend's build (native: its C
ABI version and ISA path). ``spec_from_table(FILE, label=...)`` reads it back at start-up and
returns the spec to bind. If the environment has changed since the measurement, it refuses
with ``StaleTableError`` naming each changed field, or, with ``on_stale="retune"``,
measures again and rewrites the file. The table is read when the runner is bound, never per
layer: a bound spec from a table dispatches exactly as one written by hand.

The format (``FORMAT``, ``VERSION``) is documented in docs/guides/tune.md; a reader refuses
versions it does not know, and malformed or oversized files, with ``DispatchTableError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import DispatchTableError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import StaleTableError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec
from attn_dispatch._spec import Buckets

if TYPE_CHECKING:
    from attn_dispatch.tune import TuneReport
    from attn_dispatch.tune import TuneSizes

__all__ = [
    "FORMAT",
    "MAX_TABLE_BYTES",
    "READS",
    "VERSION",
    "DispatchTable",
    "DispatchTableError",
    "PhaseChoice",
    "StaleTableError",
    "backend_build",
    "current_environment",
    "spec_from_table",
    "tune_table",
]

#: The ``"format"`` field of every table.
FORMAT = "attn_dispatch.dispatch_table"
#: The version this library writes (2: shape buckets per phase).
VERSION = 2
#: The versions it reads (a version 1 table is read as one without buckets).
READS = (1, 2)
#: A table of a few runners is a few kB; anything past this is not one (refused unread).
MAX_TABLE_BYTES = 1 << 20

_PHASES = tuple(p.name.lower() for p in Phase)
_ENV_KEYS = ("attn_dispatch", "torch", "device", "threads", "builds")


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseChoice:
    """One layer group x phase: the winner and the runner-up (None when only one backend
    served it), their times per forward in milliseconds, and the shape they were timed at
    (``batch`` requests of ``q_len`` new tokens over ``context`` tokens)."""

    winner: str
    winner_ms: float
    runner_up: str | None
    runner_up_ms: float | None
    shape: Mapping[str, int]
    #: Version 2: the shape buckets tune emitted (``{"measure", "limits"}``) or None.
    buckets: Mapping[str, Any] | None = None
    #: Version 2: every size timed, ``[{"size": n, "times": {backend: [ms, noise_ms]}}]``
    #: (noise: the range of the timed forwards; null when not measured).
    measured: Sequence[Mapping[str, Any]] = ()
    #: Version 2: the backend the spec names for the phase (the catch-all, with buckets):
    #: over several sizes, not always the winner at the main size (``tune.decide``).
    choice: str | None = None

    def describe(self) -> str:
        up = (
            "no runner-up"
            if self.runner_up is None
            else f"runner-up {self.runner_up} {self.runner_up_ms:.3f} ms"
        )
        s = self.shape
        return (
            f"{self.winner} {self.winner_ms:.3f} ms ({up}) at batch {s['batch']}, "
            f"q_len {s['q_len']}, context {s['context']}"
        )

    def spec_text(self) -> str:
        """How the phase is served: the winner, or its buckets (``q_len<=256:native|sdpa``)."""
        b = self.buckets
        name = self.choice if self.choice is not None else self.winner
        if b is None:
            return name
        head = "|".join(f"{b['measure']}<={bound}:{n}" for bound, n in b["limits"])
        return f"{head}|{name}"

    def describe_sizes(self, measure: str) -> list[str]:
        """One line per size timed: each backend's median forward and noise, fastest first."""
        lines = []
        for m in self.measured:
            times = sorted(m["times"].items(), key=lambda kv: kv[1][0])
            cells = ", ".join(
                f"{n} {ms:.3f} ms" + ("" if noise is None else f" (noise {noise:.3f})")
                for n, (ms, noise) in times
            )
            lines.append(f"{measure} {m['size']}: {cells}")
        return lines


def backend_build(name: str) -> str:
    """The build of one backend as a table records it (native: C ABI and ISA path)."""
    from importlib import metadata

    if name == "native":
        from attn_dispatch.backends.native import _lib

        lib = _lib.load()
        return f"unavailable: {lib}" if isinstance(lib, str) else (
            f"abi {lib.abi_version}, isa {lib.isa}"
        )  # fmt: skip
    if name in ("torch", "sdpa"):
        import torch

        return f"torch {torch.__version__}"
    for dist in {"triton": ("triton",), "flashinfer": ("flashinfer-python", "flashinfer")}.get(
        name, ()
    ):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    if name in ("triton", "flashinfer"):
        return "not installed"
    return "third-party (build not tracked)"


def _device_name(device: str) -> str:
    import platform

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "cuda (no device)"
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def current_environment(device: str, backends: Sequence[str]) -> dict[str, Any]:
    """What a table measured for ``device`` with ``backends`` holds for, here and now."""
    import torch

    from attn_dispatch._version import __version__

    return {
        "attn_dispatch": __version__,
        "torch": str(torch.__version__),
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "builds": {n: backend_build(n) for n in sorted(set(backends))},
    }


def _shape(phase: str, sizes: TuneSizes) -> dict[str, int]:
    if phase == "prefill":
        return {"batch": sizes.prefill_batch, "q_len": sizes.prefill_len,
                "context": sizes.prefill_len}  # fmt: skip
    if phase == "decode":
        return {"batch": sizes.decode_batch, "q_len": 1, "context": sizes.context}
    return {"batch": sizes.decode_batch, "q_len": sizes.draft_tokens,
            "context": sizes.context + sizes.draft_tokens}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DispatchTable:
    """A saved set of tuned choices (see the module doc). ``data`` is the validated JSON
    object; read it through the methods."""

    data: Mapping[str, Any]
    source: str = "<table>"

    def __post_init__(self) -> None:
        _validated(self.data, self.source)  # however it was made, a table is well-formed

    # -- building and writing ------------------------------------------------------------

    @classmethod
    def from_reports(
        cls,
        reports: Mapping[str, TuneReport],
        configs: Mapping[str, Mapping[str, AttnConfig]],
    ) -> DispatchTable:
        """One table from ``tune``'s reports, per runner label (``configs[label][group]`` is
        the config that group was tuned with)."""
        from attn_dispatch.tune import _main_size
        from attn_dispatch.tune import decide

        runners: dict[str, Any] = {}
        timed: set[str] = set()
        device = "cpu"
        sizes_seen: dict[str, Any] | None = None
        for label, report in reports.items():
            sizes = {  # as JSON holds them: lists, not tuples
                k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(report.sizes).items()
            }
            if sizes_seen not in (None, sizes):
                raise InvalidSpecError("reports", label, "every report must use the same sizes")
            sizes_seen = sizes
            groups: dict[str, Any] = {}
            for group, config in configs[label].items():
                device = config.device
                phases: dict[str, Any] = {}
                layers = report.sizes.layers
                for phase in _PHASES:
                    every = [t for t in report.timings if t.group == group and t.phase == phase]
                    timed.update(t.backend for t in every)
                    main = _main_size(phase, report.sizes)
                    cells = [t for t in every if t.size in (0, main)]
                    served = sorted(
                        (t for t in cells if t.call_s is not None),
                        key=lambda t: t.forward_s(layers) or math.inf,
                    )
                    if not served:
                        continue
                    ms = [(t.forward_s(layers) or 0.0) * 1e3 for t in served]
                    decision = decide(phase, every, report.sizes)
                    buckets = None
                    if decision is not None and decision.limits:
                        buckets = {
                            "measure": decision.measure,
                            "limits": [[b, n] for b, n in decision.limits],
                        }
                    measured: dict[int, dict[str, Any]] = {}
                    for t in every:
                        f = t.forward_s(layers)
                        if f is None or not t.size:
                            continue
                        noise = None if t.noise_s is None else round(t.noise_s * 1e3, 6)
                        measured.setdefault(t.size, {})[t.backend] = [round(f * 1e3, 6), noise]
                    phases[phase] = {
                        "winner": served[0].backend,
                        "winner_ms": round(ms[0], 6),
                        "runner_up": served[1].backend if len(served) > 1 else None,
                        "runner_up_ms": round(ms[1], 6) if len(served) > 1 else None,
                        "shape": _shape(phase, report.sizes),
                        "buckets": buckets,
                        "choice": served[0].backend if decision is None else decision.rest,
                        "measured": [{"size": n, "times": measured[n]} for n in sorted(measured)],
                    }
                groups[group] = {"config": config.to_dict(), "phases": phases}
            runners[label] = groups
        data = {
            "format": FORMAT,
            "version": VERSION,
            "environment": current_environment(device, sorted(timed)),
            "sizes": sizes_seen or {},
            "runners": runners,
        }
        return cls(data, "<new table>")

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=True) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table to ``path`` atomically (a reader never sees half a file)."""
        target = Path(path)
        fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- reading -------------------------------------------------------------------------

    @classmethod
    def from_json(cls, text: str, *, source: str = "<text>") -> DispatchTable:
        if not isinstance(text, str):
            raise DispatchTableError(source, "text", f"expected str, got {type(text).__name__}")
        if len(text) > MAX_TABLE_BYTES:
            raise DispatchTableError(
                source, "size", f"{len(text)} characters, over {MAX_TABLE_BYTES}: not a table"
            )
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: also ints over 4300 digits
            raise DispatchTableError(source, "json", f"not JSON: {exc}") from None
        return cls(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DispatchTable:
        source = str(path)
        try:
            size = os.stat(path).st_size
            if size > MAX_TABLE_BYTES:
                raise DispatchTableError(
                    source, "size", f"{size} bytes, over {MAX_TABLE_BYTES}: not a table"
                )
            with open(path, "rb") as f:
                raw = f.read(MAX_TABLE_BYTES + 1)
        except OSError as exc:
            raise DispatchTableError(source, "file", f"cannot read it: {exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DispatchTableError(source, "file", f"not UTF-8: {exc}") from None
        return cls.from_json(text, source=source)

    def fingerprint(self) -> str:
        """A short hash of the canonical JSON: ranks that loaded the same table agree on it."""
        canon = json.dumps(self.data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]

    @property
    def environment(self) -> Mapping[str, Any]:
        return self.data["environment"]  # type: ignore[no-any-return]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(sorted(self.data["runners"]))

    def groups(self, label: str) -> tuple[str, ...]:
        return tuple(sorted(self._runner(label)))

    def config(self, label: str, group: str = "") -> AttnConfig:
        return AttnConfig(**self._group(label, group)["config"])

    def choice(self, label: str, group: str, phase: Phase | str) -> PhaseChoice:
        name = phase.name.lower() if isinstance(phase, Phase) else phase
        got = self._group(label, group)["phases"].get(name)
        if got is None:
            raise DispatchTableError(
                self.source,
                f"runners.{label}.{group}.phases",
                f"no backend served {name!r} when it was tuned; choose one by hand",
            )
        return PhaseChoice(**got)

    def spec(self, label: str, group: str = "") -> BackendSpec:
        """The tuned spec of one runner label and layer group; its ``note`` says where it came
        from (the table's fingerprint), which ``explain`` and ``check_agreement`` show."""
        c = {p: self.choice(label, group, p).spec_text() for p in _PHASES}
        text = f"prefill={c['prefill']},decode={c['decode']}"
        if c["verify"] != c["prefill"] or "|" in c["verify"]:
            # verify=None would follow prefill's buckets too: name verify's own choice.
            text += f",verify={c['verify']}"
        spec = BackendSpec.parse(text)
        return dataclasses.replace(
            spec, note=f"dispatch table {self.fingerprint()}: label {label!r}, group {group!r}"
        )

    def explain(self, label: str) -> str:
        """Where each choice of one runner came from, one line per group x phase."""
        lines = [f"dispatch table {self.source} ({self.fingerprint()}), runner {label!r}:"]
        for group in self.groups(label):
            for phase in _PHASES:
                try:
                    choice = self.choice(label, group, phase)
                except DispatchTableError:
                    lines.append(f"  {group or '-'} {phase}: no backend served it when tuned")
                    continue
                lines.append(f"  {group or '-'} {phase}: {choice.describe()}")
                measure = "q_len" if phase == "prefill" else "context"
                if choice.buckets is not None:
                    lines.append(
                        f"    buckets {choice.spec_text()}: the winner changes with {measure} "
                        "by more than the noise at each change"
                    )
                elif len(choice.measured) > 1:
                    lines.append(
                        f"    no buckets: one winner at every {measure}, or a change within "
                        "the noise"
                    )
                if len(choice.measured) > 1:
                    lines.extend(f"      {line}" for line in choice.describe_sizes(measure))
        env = self.environment
        lines.append(
            f"  measured with attn_dispatch {env['attn_dispatch']}, torch {env['torch']}, "
            f"{env['device']}, {env['threads']} threads, builds {dict(env['builds'])!r}"
        )
        return "\n".join(lines)

    def stale_fields(self, environment: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Each environment field that differs from ``environment`` (default: here, now),
        as ``{field: (saved, now)}``."""
        saved = self.environment
        if environment is None:
            environment = current_environment(self._device(), list(saved["builds"]))
        diffs: dict[str, Any] = {}
        for key in _ENV_KEYS:
            if key == "builds":
                names = sorted(set(saved["builds"]) | set(environment.get("builds", {})))
                for n in names:
                    a = saved["builds"].get(n, "<not timed>")
                    b = environment.get("builds", {}).get(n, "<not here>")
                    if a != b:
                        diffs[f"builds.{n}"] = (a, b)
            elif saved.get(key) != environment.get(key):
                diffs[key] = (saved.get(key), environment.get(key))
        return diffs

    def check_environment(self, environment: Mapping[str, Any] | None = None) -> None:
        """Raise ``StaleTableError`` naming each changed field, unless nothing changed."""
        diffs = self.stale_fields(environment)
        if diffs:
            raise StaleTableError(self.source, diffs)

    def retune(self, *, registry: Any = None) -> DispatchTable:
        """Measure every runner of this table again, here, at its sizes and backends."""
        from attn_dispatch.tune import TuneSizes

        configs = {
            label: {g: self.config(label, g) for g in self.groups(label)} for label in self.labels
        }
        return tune_table(
            configs,
            sizes=TuneSizes(**self.data["sizes"]),
            backends=list(self.environment["builds"]),
            registry=registry,
        )

    # -- internals -----------------------------------------------------------------------

    def _runner(self, label: str) -> Mapping[str, Any]:
        runners = self.data["runners"]
        if label not in runners:
            raise DispatchTableError(
                self.source, "label", f"no runner {label!r}; the table holds {self.labels!r}"
            )
        return runners[label]  # type: ignore[no-any-return]

    def _group(self, label: str, group: str) -> Mapping[str, Any]:
        groups = self._runner(label)
        if group not in groups:
            raise DispatchTableError(
                self.source,
                "group",
                f"runner {label!r} has no group {group!r}; it has {sorted(groups)!r}",
            )
        return groups[group]  # type: ignore[no-any-return]

    def _device(self) -> str:
        for label in self.labels:
            for group in self.groups(label):
                return str(self._group(label, group)["config"].get("device", "cpu"))
        return "cpu"


def _validated(data: Any, source: str) -> dict[str, Any]:
    """``data`` if it is a well-formed table of a known version; else ``DispatchTableError``
    naming the first bad field."""

    def need(cond: bool, field: str, problem: str) -> None:
        if not cond:
            raise DispatchTableError(source, field, problem)

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_ms(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    need(isinstance(data, dict), "table", "expected a JSON object")
    need(data.get("format") == FORMAT, "format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    version = data.get("version")
    need(
        is_int(version) and version in READS,
        "version",
        f"version {version!r} is not one this attn_dispatch reads (it reads "
        f"{' and '.join(map(str, READS))}); "
        "re-run `python -m attn_dispatch tune ... --save FILE` with this version",
    )
    unknown = sorted(set(data) - {"format", "version", "environment", "sizes", "runners"})
    need(not unknown, "table", f"unknown fields {unknown!r}")
    env = data.get("environment")
    need(isinstance(env, dict), "environment", "expected an object")
    for key in _ENV_KEYS:
        need(key in env, f"environment.{key}", "missing")
    for key in ("attn_dispatch", "torch", "device"):
        need(isinstance(env[key], str), f"environment.{key}", "expected a string")
    need(is_int(env["threads"]), "environment.threads", "expected an int")
    builds = env["builds"]
    need(
        isinstance(builds, dict) and all(isinstance(v, str) for v in builds.values()),
        "environment.builds",
        "expected an object of backend name to build string",
    )
    sizes = data.get("sizes")
    need(isinstance(sizes, dict), "sizes", "expected an object")
    from attn_dispatch.tune import TuneSizes

    try:
        TuneSizes(**sizes)
    except (TypeError, InvalidSpecError) as exc:
        raise DispatchTableError(source, "sizes", str(exc)) from None
    runners = data.get("runners")
    need(isinstance(runners, dict) and bool(runners), "runners", "expected a non-empty object")
    for label, groups in runners.items():
        where = f"runners.{label}"
        need(isinstance(groups, dict) and bool(groups), where, "expected a non-empty object")
        for group, entry in groups.items():
            at = f"{where}.{group}"
            need(isinstance(entry, dict), at, "expected an object")
            need(set(entry) == {"config", "phases"}, at, "expected 'config' and 'phases'")
            need(isinstance(entry["config"], dict), f"{at}.config", "expected an object")
            try:
                AttnConfig(**entry["config"])
            except (TypeError, InvalidSpecError) as exc:
                raise DispatchTableError(source, f"{at}.config", str(exc)) from None
            phases = entry["phases"]
            need(isinstance(phases, dict), f"{at}.phases", "expected an object")
            for phase, c in phases.items():
                pat = f"{at}.phases.{phase}"
                need(phase in _PHASES, pat, f"unknown phase; phases are {_PHASES!r}")
                need(isinstance(c, dict), pat, "expected an object")
                keys = {"winner", "winner_ms", "runner_up", "runner_up_ms", "shape"}
                if version >= 2:
                    keys |= {"buckets", "choice", "measured"}
                need(set(c) == keys, pat, f"expected the fields {sorted(keys)!r}")
                need(isinstance(c["winner"], str) and bool(c["winner"]), f"{pat}.winner", "")
                need(is_ms(c["winner_ms"]), f"{pat}.winner_ms", "expected a finite number")
                up, up_ms = c["runner_up"], c["runner_up_ms"]
                need(
                    (up is None and up_ms is None) or (isinstance(up, str) and is_ms(up_ms)),
                    f"{pat}.runner_up",
                    "expected a name and a finite time, or both null",
                )
                shape = c["shape"]
                need(
                    isinstance(shape, dict)
                    and set(shape) == {"batch", "q_len", "context"}
                    and all(is_int(v) and v >= 1 for v in shape.values()),
                    f"{pat}.shape",
                    "expected {batch, q_len, context} as ints >= 1",
                )
                if version >= 2:
                    _check_v2(source, c, pat, phase, need, is_int, is_ms)
    return data  # type: ignore[no-any-return]


def _check_v2(
    source: str, c: Mapping[str, Any], pat: str, phase: str, need: Any, is_int: Any, is_ms: Any
) -> None:
    """A version 2 phase entry's ``buckets`` and ``measured`` fields."""
    need(
        isinstance(c["choice"], str) and bool(c["choice"]),
        f"{pat}.choice",
        "expected the backend name the spec uses",
    )
    b = c["buckets"]
    if b is not None:
        need(
            isinstance(b, dict) and set(b) == {"measure", "limits"},
            f"{pat}.buckets",
            "expected null or {measure, limits}",
        )
        limits = b["limits"]
        need(
            isinstance(limits, list)
            and all(
                isinstance(x, list) and len(x) == 2 and is_int(x[0]) and isinstance(x[1], str)
                for x in limits
            ),
            f"{pat}.buckets.limits",
            "expected [[bound, backend], ...]",
        )
        try:
            Buckets(phase, b["measure"], tuple((x[0], x[1]) for x in limits))
            BackendSpec(prefill=c["choice"], decode=c["choice"])
        except InvalidSpecError as exc:
            raise DispatchTableError(source, f"{pat}.buckets", str(exc)) from None
    measured = c["measured"]
    need(isinstance(measured, list), f"{pat}.measured", "expected a list")
    for i, m in enumerate(measured):
        at = f"{pat}.measured[{i}]"
        need(
            isinstance(m, dict) and set(m) == {"size", "times"} and is_int(m["size"]),
            at,
            "expected {size, times}",
        )
        times = m["times"]
        need(
            isinstance(times, dict)
            and all(
                isinstance(v, list)
                and len(v) == 2
                and is_ms(v[0])
                and (v[1] is None or is_ms(v[1]))
                for v in times.values()
            ),
            f"{at}.times",
            "expected backend -> [ms, noise_ms or null]",
        )


def tune_table(
    configs: Mapping[str, Mapping[str, AttnConfig]],
    *,
    sizes: TuneSizes | None = None,
    backends: Sequence[str] | None = None,
    registry: Any = None,
) -> DispatchTable:
    """Tune every runner (``configs[label][group]``) and return the table (not yet saved)."""
    from attn_dispatch.tune import tune

    reports = {
        label: tune(groups, sizes=sizes, backends=backends, registry=registry)
        for label, groups in configs.items()
    }
    return DispatchTable.from_reports(reports, configs)


def spec_from_table(
    path: str | os.PathLike[str],
    *,
    label: str | None = None,
    on_stale: Literal["raise", "retune"] = "raise",
    registry: Any = None,
) -> BackendSpec | dict[str, BackendSpec]:
    """The tuned spec of runner ``label`` from the table at ``path``, checked at start-up.

    Returns a ``BackendSpec`` for a runner with one kind of layer (group ``""``), else a
    mapping of group to spec; either goes to ``bind`` as it is. ``label=None`` takes the
    table's only runner. A table measured in another environment raises ``StaleTableError``
    naming each changed field; ``on_stale="retune"`` measures every runner of the table again
    here instead, rewrites ``path`` (atomically) and returns the new choice.
    """
    if on_stale not in ("raise", "retune"):
        raise InvalidSpecError("on_stale", on_stale, "choose 'raise' (default) or 'retune'")
    table = DispatchTable.load(path)
    if label is None:
        if len(table.labels) != 1:
            raise DispatchTableError(
                table.source, "label", f"the table holds {table.labels!r}: name one with label="
            )
        label = table.labels[0]
    table.groups(label)  # an unknown label is refused before anything is measured
    diffs = table.stale_fields()
    if diffs:
        if on_stale == "raise":
            raise StaleTableError(table.source, diffs)
        fresh = table.retune(registry=registry)
        fresh.save(path)
        table = DispatchTable(fresh.data, str(path))
    groups = table.groups(label)
    if groups == ("",):
        return table.spec(label, "")
    return {g: table.spec(label, g) for g in groups}
