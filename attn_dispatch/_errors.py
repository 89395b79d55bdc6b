"""Error types. Each also subclasses the builtin it refines (``except ValueError`` works)."""

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


class UnknownBackendError(AttnDispatchError, KeyError):
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


class IncompatibleBackendError(AttnDispatchError, ValueError):
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


class NoActiveScopeError(AttnDispatchError, RuntimeError):
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


class BackendUnavailableError(AttnDispatchError, RuntimeError):
    """A backend whose factory could not be loaded or built, or built something unusable."""

    name: str  # the backend
    reason: str
    runner: str | None  # the label bind was given, or None

    def __init__(self, name: str, reason: str, *, runner: str | None = None) -> None:
        who = f" for runner {runner!r}" if runner is not None else ""
        message = f"attention backend {name!r} is unavailable{who}: {reason}"
        self._carry(message, name=name, reason=reason, runner=runner)


class UnknownPhaseError(AttnDispatchError, ValueError):
    """A phase or forward-mode name we do not know. Attributes: ``name``, ``known``."""

    def __init__(self, name: str, known: tuple[str, ...], *, hint: str = "") -> None:
        self.name = name
        self.known = known
        tail = f" {hint}" if hint else ""
        super().__init__(
            f"unknown phase or forward mode {name!r}; known names: "
            f"{', '.join(repr(k) for k in known)}.{tail}"
        )


class InvalidBatchError(AttnDispatchError, ValueError):
    """Bad batch metadata or tensors."""

    field: str  # the AttnBatch field or argument that is wrong
    problem: str
    request: int | None  # the index of the request it is wrong for, or None

    def __init__(self, field: str, problem: str, *, request: int | None = None) -> None:
        where = f"request {request}: " if request is not None else ""
        message = f"invalid attention batch: {where}{field}: {problem}"
        self._carry(message, field=field, problem=problem, request=request)


class ScopeError(AttnDispatchError, RuntimeError):
    """A scope used wrongly: exited out of order, exited twice, or re-entered."""


class InvalidSpecError(AttnDispatchError, ValueError):
    """A BackendSpec or AttnConfig with bad values. Attributes: ``field``, ``value``."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {problem}")


class DuplicateBackendError(AttnDispatchError, ValueError):
    """``register_backend`` with a name already taken and ``replace=False``."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"an attention backend named {name!r} is already registered; pass replace=True to "
            "replace it (existing bindings keep the old one), or choose another name."
        )


class RankFailedError(AttnDispatchError, RuntimeError):
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

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the constructor's arguments: an error raised in a worker reaches the
        # parent process with the same type, fields and message.
        return (type(self), (self.failures, self.world, self.rank))
