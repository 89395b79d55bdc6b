"""Every error attn_dispatch raises, in two kinds a server handles differently.

A start-up error refuses to start (fix the configuration and restart); a per-call error fails
one request (answer it with an error and keep serving), and a usage error among those is a
bug in the calling code. Each class also subclasses the builtin it refines (``except
ValueError`` works), carries the offending values as attributes, and survives pickling with
its type, attributes and message (a worker's error reaches the parent process intact)::

    AttnDispatchError
    ├── StartupError                  refuse to start
    │   ├── UnknownBackendError       (KeyError)     a backend name nobody registered
    │   ├── IncompatibleBackendError  (ValueError)   bind refuses: every reason per phase
    │   ├── InvalidSpecError          (ValueError)   a spec, config or option value
    │   ├── BackendUnavailableError   (RuntimeError) a backend that cannot be built here
    │   ├── DuplicateBackendError     (ValueError)   a name registered twice
    │   ├── UnsupportedModelError     (ValueError)   a model an integration cannot serve
    │   ├── RankMismatchError         (RuntimeError) ranks that bound different things
    │   ├── RankFailedError           (RuntimeError) a rank failed before the agreement check
    │   ├── NoProcessGroupError       (RuntimeError) a rank check without a process group
    │   ├── DispatchTableError        (ValueError)   a dispatch table that cannot be read
    │   ├── StaleTableError           (RuntimeError) a table measured in another environment
    │   ├── InvalidKVLayoutError      (ValueError)   a KV layout descriptor with a bad field
    │   └── IncompatibleKVLayoutError (ValueError)   two bindings that read KV pages differently
    └── CallError                     fail one request
        ├── InvalidBatchError         (ValueError)   a batch, tensor, plan or call argument
        ├── NoActiveScopeError        (RuntimeError) dispatch outside every attn_scope
        ├── ScopeError                (RuntimeError) a scope exited out of order or twice
        ├── UnknownPhaseError         (ValueError)   not a Phase / an unknown forward mode
        ├── CaptureError              (RuntimeError) a CUDA-graph rule broken
        ├── UsageError                (RuntimeError) an API called in a way it does not take
        └── CacheFullError            (MemoryError)  the demo's page pool is exhausted

``tests/core/test_errors.py`` holds this tree against the classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

# No import of _phase here: _phase imports this module, and a phase is read below only through
# its ``name`` and ``value`` (so the per-phase mappings are typed ``Any``).


class AttnDispatchError(Exception):
    """Base class of every error raised by attn_dispatch."""

    def _carry(self, message: str, **values: object) -> None:
        """Keep the offending ``values`` as attributes (every error here carries them, so a
        caller can act on them without parsing the message), then ``message``."""
        for name, value in values.items():
            setattr(self, name, value)
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce re-calls cls(*args): with __init__(name, reasons, ...) that
        # fails in the unpickling process (a worker's error became BrokenProcessPool) or
        # wraps the message twice. Instead the instance is made without __init__ from its
        # args (the message) and gets its attributes back. Exception.__new__, not cls.__new__:
        # every class here has AttnDispatchError first, so Exception's is the constructor its
        # instances are made with (MemoryError's own, which CacheFullError's lookup finds,
        # refuses a subclass whose first base is ours); and a pickle names only builtins and
        # the public class, never a private helper.
        return (Exception.__new__, (type(self), *self.args), self.__dict__ or None)


class StartupError(AttnDispatchError):
    """A configuration that cannot serve: refuse to start (raised by ``bind``, the registry,
    the integrations' set-up, the cross-rank check); fix it and restart."""


class CallError(AttnDispatchError):
    """One request (one forward or one call) that cannot be served: fail that request and
    keep serving; the binding, the scope stack and every other runner are unchanged."""


class UnknownBackendError(StartupError, KeyError):
    """A backend name that is not registered.

    Attributes: ``name``, ``registered`` (sorted names), ``suggestions`` (close matches).
    """

    def __init__(self, name: str, registered: Iterable[str], *, context: str = "") -> None:
        self.name = name
        self.registered = tuple(sorted(registered))
        import difflib  # only when an error is raised

        self.suggestions = tuple(difflib.get_close_matches(name, self.registered, n=3, cutoff=0.5))
        where = f"{context}: " if context else ""
        hint = (
            f" Did you mean {' or '.join(repr(s) for s in self.suggestions)}?"
            if self.suggestions
            else ""
        )
        choices = ", ".join(repr(r) for r in self.registered) or "(none)"
        self.message = (
            f"{where}unknown attention backend {name!r}.{hint} "
            f"Registered backends: {choices}. Register a new one with "
            f"attn_dispatch.backend.register_backend(name, capabilities=..., factory=...)."
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return self.message


class IncompatibleBackendError(StartupError, ValueError):
    """A spec that cannot serve a config, with every reason of every phase.

    Attributes: ``label``; ``reasons``: mapping phase -> (backend name, tuple of reasons).
    """

    def __init__(
        self,
        label: str | None,
        reasons: Mapping[Any, tuple[str, Sequence[str]]],
        *,
        config: object = None,
    ) -> None:
        self.label = label
        self.reasons = {p: (b, tuple(r)) for p, (b, r) in reasons.items()}
        self.config = config
        who = f"runner {label!r}" if label is not None else "this runner"
        lines = [f"cannot bind attention backends for {who}:"]
        for phase, (backend, why) in sorted(self.reasons.items(), key=lambda kv: kv[0].value):
            for reason in why:
                lines.append(f"  - {phase.name.lower()} -> {backend!r}: {reason}")
        lines.append(
            "Choose another backend for the phases above (see `python -m attn_dispatch list`), "
            "or change the config."
        )
        super().__init__("\n".join(lines))


class NoActiveScopeError(CallError, RuntimeError):
    """Dispatch was asked for outside every ``attn_scope``."""

    def __init__(self, what: str = "resolve") -> None:
        self.what = what
        super().__init__(
            f"{what}() was called outside any attention scope: no runner is active in this "
            "context. Wrap the runner's forward in `with attn_dispatch.attn_scope(runner, batch):` "
            "(threads start with an empty context: use attn_dispatch.run_in_thread, "
            "attn_dispatch.carry_scope or contextvars.copy_context().run to carry the scope into "
            "a worker)."
        )


class BackendUnavailableError(StartupError, RuntimeError):
    """A backend whose factory could not be loaded or built, or built something unusable."""

    name: str  # the backend
    reason: str
    runner: str | None  # the label bind was given, or None

    def __init__(self, name: str, reason: str, *, runner: str | None = None) -> None:
        who = f" for runner {runner!r}" if runner is not None else ""
        message = f"attention backend {name!r} is unavailable{who}: {reason}"
        self._carry(message, name=name, reason=reason, runner=runner)


class UnknownPhaseError(CallError, ValueError):
    """A phase or forward-mode name we do not know. Attributes: ``name``, ``known``."""

    def __init__(self, name: str, known: tuple[str, ...], *, hint: str = "") -> None:
        self.name = name
        self.known = known
        tail = f" {hint}" if hint else ""
        super().__init__(
            f"unknown phase or forward mode {name!r}; known names: "
            f"{', '.join(repr(k) for k in known)}.{tail}"
        )


class InvalidBatchError(CallError, ValueError):
    """Bad batch metadata or tensors."""

    field: str  # the AttnBatch field or argument that is wrong
    problem: str
    request: int | None  # the index of the request it is wrong for, or None

    def __init__(self, field: str, problem: str, *, request: int | None = None) -> None:
        where = f"request {request}: " if request is not None else ""
        message = f"invalid attention batch: {where}{field}: {problem}"
        self._carry(message, field=field, problem=problem, request=request)


class ScopeError(CallError, RuntimeError):
    """A scope used wrongly: exited out of order, exited twice, or re-entered."""


class InvalidSpecError(StartupError, ValueError):
    """A BackendSpec or AttnConfig with bad values. Attributes: ``field``, ``value``."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {problem}")


class DuplicateBackendError(StartupError, ValueError):
    """``register_backend`` with a name already taken and ``replace=False``."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"an attention backend named {name!r} is already registered; pass replace=True to "
            "replace it (existing bindings keep the old one), or choose another name."
        )


class UnsupportedModelError(StartupError, ValueError):
    """A model (or a mask, cache or option it asks for) that an integration cannot serve
    faithfully (the transformers and vLLM integrations); the message names what and the
    choices."""


class RankMismatchError(StartupError, RuntimeError):
    """Ranks of one process group bound runners that cannot work together.

    ``differences`` maps ``"<runner>.<field>"`` to the value each rank holds (rank order);
    ``world``: the number of ranks.
    """

    def __init__(self, differences: Mapping[str, Sequence[Any]], world: int) -> None:
        self.differences = dict(differences)
        self.world = world
        lines = []
        for key, values in self.differences.items():
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            lines.append(f"  {key}: {per_rank}")
        super().__init__(
            f"the {world} ranks of this process group bound runners that disagree on "
            f"{len(self.differences)} field(s):\n" + "\n".join(lines) + "\nEvery rank must bind "
            "the same spec per runner label, configs equal up to the per-rank head split, and "
            "the same attn_dispatch build; fix the rank(s) whose value differs and restart."
        )


class NoProcessGroupError(StartupError, RuntimeError):
    """A cross-rank check (``attn_dispatch.distributed``) asked for without an initialised
    ``torch.distributed`` process group."""

    def __init__(self, what: str = "check_agreement") -> None:
        self.what = what
        super().__init__(
            f"{what} needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) on every rank first (or pass group=)"
        )


class CaptureError(CallError, RuntimeError):
    """A CUDA-graph rule broken: planning during capture, or another runner inside a graph."""


class UsageError(CallError, RuntimeError):
    """An API called in a way it does not take (a bug in the calling code, not bad request
    data): ``attention()`` in a scope opened without a batch, ``group=`` on a runner bound
    without groups (or a group it does not have), a prepared plan of another binding.

    Attributes: ``api`` (the function or argument misused), ``problem``.
    """

    api: str
    problem: str

    def __init__(self, api: str, problem: str) -> None:
        self._carry(f"{api}: {problem}", api=api, problem=problem)


class CacheFullError(CallError, MemoryError):
    """A runner's page pool has too few free pages (the demo's allocator). Attributes:
    ``label``, ``requested``, ``free``, ``num_pages``."""

    def __init__(self, label: str, requested: int, free: int, num_pages: int) -> None:
        self.label, self.requested, self.free, self.num_pages = label, requested, free, num_pages
        super().__init__(
            f"runner {label!r}: {requested} pages requested, {free} of {num_pages} free; pass "
            "a larger --num-pages or fewer tokens"
        )


class DispatchTableError(StartupError, ValueError):
    """A dispatch table that cannot be read: not JSON, too large, an unknown format version,
    a missing or ill-typed field, or a label/group it does not hold (a start-up error).

    Attributes: ``source`` (the path or ``"<text>"``), ``field``, ``problem``.
    """

    source: str
    field: str
    problem: str

    def __init__(self, source: str, field: str, problem: str) -> None:
        self._carry(
            f"dispatch table {source}: {field}: {problem}",
            source=source,
            field=field,
            problem=problem,
        )


class StaleTableError(StartupError, RuntimeError):
    """A dispatch table measured in another environment (a start-up error).

    ``differences`` maps each changed field (``"torch"``, ``"builds.native"``, ...) to
    ``(saved, now)``.
    """

    source: str
    differences: dict[str, tuple[Any, Any]]

    def __init__(self, source: str, differences: Mapping[str, tuple[Any, Any]]) -> None:
        diffs = dict(differences)
        lines = [f"  {k}: saved {a!r}, now {b!r}" for k, (a, b) in diffs.items()]
        self._carry(
            f"dispatch table {source} was measured in another environment; "
            f"{len(diffs)} field(s) changed:\n" + "\n".join(lines) + "\nRe-run "
            "`python -m attn_dispatch tune ... --save FILE` here, or pass on_stale='retune' "
            "to measure again at start-up.",
            source=source,
            differences=diffs,
        )


class InvalidKVLayoutError(StartupError, ValueError):
    """A KV layout descriptor with a bad field, or bytes that are not one (a start-up error).

    Attributes: ``field``, ``value``, ``problem``.
    """

    field: str
    value: object
    problem: str

    def __init__(self, field: str, value: object, problem: str) -> None:
        self._carry(
            f"KV layout: {field}={value!r}: {problem}", field=field, value=value, problem=problem
        )


class IncompatibleKVLayoutError(StartupError, ValueError):
    """Two bindings whose KV pages would be read differently (a start-up error).

    ``differences`` maps each differing field to ``(a's value, b's value)``.
    """

    differences: dict[str, tuple[Any, Any]]

    def __init__(self, differences: Mapping[str, tuple[Any, Any]]) -> None:
        diffs = dict(differences)
        lines = [f"  {k}: {a!r} != {b!r}" for k, (a, b) in diffs.items()]
        self._carry(
            f"KV pages cannot be handed between these two layouts: {len(diffs)} field(s) "
            "differ:\n" + "\n".join(lines) + "\nBind both sides with the same KV layout "
            "(page size, heads per rank, head dims, KV dtype and scales, LSE base), or convert "
            "the pages on the way.",
            differences=diffs,
        )


class RankFailedError(StartupError, RuntimeError):
    """A collective check across ranks (``distributed.check_agreement``) that some rank could
    not take part in: it failed on its own input before the exchange. Every rank raises it
    (none waits for the failed one), naming each failed rank and why.

    Attributes: ``failures`` (rank -> ``"ErrorType: message"``), ``world``, ``rank`` (the rank
    that raised this copy).
    """

    failures: dict[int, str]
    world: int
    rank: int

    def __init__(self, failures: Mapping[int, str], world: int, rank: int) -> None:
        failures = dict(sorted(failures.items()))
        lines = "\n".join(f"  rank {r}: {why}" for r, why in failures.items())
        who = ", ".join(str(r) for r in failures)
        message = (
            f"rank(s) {who} of the {world} ranks of this process group failed before the "
            f"agreement check (seen on rank {rank}):\n{lines}\nFix the input of the rank(s) "
            "named above and restart every rank."
        )
        self._carry(message, failures=failures, world=world, rank=rank)
