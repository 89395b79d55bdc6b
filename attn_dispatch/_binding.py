"""bind(): check a spec against a config, build backends once, precompute handlers."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import AttentionBackend
from attn_dispatch._protocol import Handler
from attn_dispatch._registry import get_backend
from attn_dispatch._spec import BackendSpec


class Binding:
    """The immutable result of ``bind``: one runner's backends and per-phase handlers.

    It holds its own references to the backend objects and capabilities it was built from,
    so later registry changes never reach it. A ``Binding`` is itself a runner
    (``binding.attn_binding is binding``), so ``attn_scope(binding)`` works.
    """

    __slots__ = ("_backends", "_caps", "_handlers", "_phase_backends", "config", "label", "spec")

    spec: BackendSpec
    config: AttnConfig
    label: str | None
    _handlers: tuple[Handler, Handler, Handler]
    _phase_backends: tuple[AttentionBackend, AttentionBackend, AttentionBackend]
    _backends: Mapping[str, AttentionBackend]
    _caps: Mapping[str, Capabilities]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Binding objects are made by attn_dispatch.bind(spec, config)")

    @classmethod
    def _make(
        cls,
        spec: BackendSpec,
        config: AttnConfig,
        label: str | None,
        backends: dict[str, AttentionBackend],
        caps: dict[str, Capabilities],
        handlers: tuple[Handler, Handler, Handler],
    ) -> Binding:
        self = object.__new__(cls)
        put = object.__setattr__
        put(self, "spec", spec)
        put(self, "config", config)
        put(self, "label", label)
        put(self, "_backends", types.MappingProxyType(dict(backends)))
        put(self, "_caps", types.MappingProxyType(dict(caps)))
        put(self, "_handlers", handlers)
        put(self, "_phase_backends", tuple(backends[n] for n in spec.names))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Binding is immutable; cannot set {name!r} (bind a new one)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Binding is immutable; cannot delete {name!r}")

    @property
    def attn_binding(self) -> Binding:
        return self

    def handler(self, phase: Phase) -> Handler:
        """The precomputed handler of ``phase``."""
        return self._handlers[Phase.parse(phase)]

    def backend(self, phase: Phase) -> AttentionBackend:
        """The backend object serving ``phase``."""
        return self._phase_backends[Phase.parse(phase)]

    def backend_name(self, phase: Phase) -> str:
        return self.spec.names[Phase.parse(phase)]

    @property
    def backends(self) -> Mapping[str, AttentionBackend]:
        """One backend object per distinct name in the spec (read-only)."""
        return self._backends

    def capabilities(self, name: str) -> Capabilities:
        """The capabilities this binding was checked against (a snapshot)."""
        return self._caps[name]

    def plan(self, batch: Any) -> Any:
        """Plan ``batch`` on the backend serving ``batch.phase`` (what ``attn_scope`` does)."""
        return self._phase_backends[batch.phase].plan(batch)

    def table(self) -> list[tuple[str, str]]:
        """``[(phase, backend), ...]`` for display."""
        return [(p.name.lower(), self.spec.names[p]) for p in Phase]

    def __repr__(self) -> str:
        label = f"{self.label!r}, " if self.label is not None else ""
        return f"<Binding {label}{self.spec!s} kind={self.config.kind!r}>"


def bind(
    spec: BackendSpec | str,
    config: AttnConfig,
    *,
    label: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Binding:
    """Check ``spec`` against ``config`` for every phase, then build the backends.

    >>> binding = bind(BackendSpec.parse("prefill=torch,decode=native"), config, label="target")
    >>> runner.attn_binding = binding

    Every reason of every phase is collected before one ``IncompatibleBackendError`` is raised;
    an unknown name raises ``UnknownBackendError``. ``options[name]`` are keyword arguments for
    that backend's factory. Nothing is ever substituted.
    """
    if isinstance(spec, str):
        spec = BackendSpec.parse(spec)
    if not isinstance(spec, BackendSpec):
        raise InvalidSpecError("spec", spec, "pass a BackendSpec or a string such as 'torch'")
    if not isinstance(config, AttnConfig):
        raise InvalidSpecError("config", config, "pass an attn_dispatch.AttnConfig")
    options = dict(options or {})
    unknown_opts = set(options) - set(spec.names)
    if unknown_opts:
        raise InvalidSpecError(
            "options",
            sorted(unknown_opts),
            f"options name backends the spec does not use (it uses {sorted(set(spec.names))!r})",
        )
    who = f"runner {label!r}" if label is not None else "bind"
    entries = {}
    for phase in Phase:
        name = spec.names[phase]
        if name not in entries:
            entries[name] = get_backend(name, context=f"{who}, phase {phase.name.lower()!r}")
    reasons: dict[Phase, tuple[str, list[str]]] = {}
    for phase in Phase:
        name = spec.names[phase]
        why = entries[name].capabilities.reasons(config, phase)
        if why:
            reasons[phase] = (name, why)
    if reasons:
        raise IncompatibleBackendError(label, reasons, config=config)
    backends: dict[str, AttentionBackend] = {}
    for name, entry in entries.items():
        factory = entry.load_factory()
        try:
            backends[name] = factory(config, **options.get(name, {}))
        except AttnDispatchError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                name, f"its factory failed for {who}: {type(exc).__name__}: {exc}"
            ) from exc
    handlers = tuple(backends[spec.names[p]].handler(p) for p in Phase)
    caps = {name: entry.capabilities for name, entry in entries.items()}
    return Binding._make(spec, config, label, backends, caps, handlers)  # type: ignore[arg-type]
