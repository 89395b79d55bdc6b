"""The result of ``bind``: a ``Binding`` (one runner's backends and per-phase routes) and its
``Route``s (how one phase is served). Made by ``attn_dispatch._binding.bind`` only."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from attn_dispatch._calls import CallRule
from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import UsageError
from attn_dispatch._forms import AttnForm
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import AttentionBackend
from attn_dispatch._protocol import Handler
from attn_dispatch._spec import BackendSpec


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Route:
    """How one phase of one (group of a) binding is served: what ``prepare`` reads.

    ``handler`` is what the binding hands out (``resolve``, ``binding.handler``, ``prepare``):
    the backend's ``raw`` callable behind the call rules (``_calls.checked_handler``), so the
    direct path checks what ``attention()`` checks. ``chooser`` picks an MLA layer's form per
    batch (None: one form); ``forms`` maps each decompressed form it may pick to
    ``(backend or None, handler, raw)`` (None: ``MHA_CHUNKED`` plans from the batch itself).
    """

    name: str
    backend: AttentionBackend
    handler: Handler
    raw: Handler
    chooser: Callable[[Any], AttnForm] | None = None
    forms: Mapping[AttnForm, tuple[AttentionBackend | None, Handler, Handler]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )

    def prepare(self, batch: Any) -> tuple[Any, Handler, Handler, AttnForm | None]:
        """``(plan, handler, raw, form)`` for ``batch`` (this route's phase)."""
        if self.chooser is None:
            return self.backend.plan(batch), self.handler, self.raw, None
        form = self.chooser(batch)
        if form is AttnForm.MLA:
            return self.backend.plan(batch), self.handler, self.raw, form
        dbackend, handler, raw = self.forms[form]
        if dbackend is None:  # MHA_CHUNKED plans from the batch itself
            return batch, handler, raw, form
        return dbackend.plan(batch.ragged()), handler, raw, form


class Binding:
    """The immutable result of ``bind``: one runner's backends and per-phase routes.

    It holds its own references to the backend objects and capabilities it was built from,
    so later registry changes never reach it. A ``Binding`` is itself a runner
    (``binding.attn_binding is binding``), so ``attn_scope(binding)`` works.

    A binding is a mapping group -> per-phase ``Route``s: a plain binding is one unnamed group
    (``binding.handler(phase)``, ``binding.config``); a grouped one
    (``bind(spec, {"sliding": cfg_a, "full": cfg_b})``) names each group's own Binding in
    ``binding.groups`` and its configs in ``binding.configs``; its own ``config``,
    ``handler``, ``backend`` and ``prepare`` need a group and raise.
    """

    __slots__ = (
        "_buckets",
        "_caps",
        "_config",
        "_groups",
        "_handler_map",
        "_routes",
        "_rule",
        "_sm_scale",
        "backends",
        "label",
        "spec",
    )

    spec: BackendSpec
    label: str | None
    #: One backend object per distinct name in the spec (read-only).
    backends: Mapping[str, AttentionBackend]
    _config: AttnConfig | None
    _caps: Mapping[str, Capabilities]
    # Phase -> Route, indexed by Phase (a plain binding); () for a grouped one.
    _routes: tuple[Route, ...]
    # Phase -> checked handler: what a scope frame holds, so that resolve() is one dict
    # lookup, which no foreign int or IntEnum can pass (Phase hashes by identity).
    _handler_map: dict[Phase, Handler]
    # The call rules of this config (None for a grouped binding: each group has its own).
    _rule: CallRule | None
    # The config's sm_scale (None: each call passes one), read by every attn_scope.
    _sm_scale: float | None
    # None, or group -> the group's own Binding (a grouped binding: bind(spec, {name: cfg})).
    _groups: Mapping[str, Binding] | None
    # None, or phase -> (batch attribute, upper bounds, one plain Binding per bucket, the
    # catch-all last): a spec with shape buckets. ``_pick(batch)`` chooses once per forward.
    _buckets: Mapping[Phase, tuple[str, tuple[int, ...], tuple[Binding, ...]]] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Binding objects are made by attn_dispatch.bind(spec, config)")

    @classmethod
    def _make(
        cls,
        spec: BackendSpec,
        config: AttnConfig | None,
        label: str | None,
        backends: Mapping[str, AttentionBackend],
        caps: Mapping[str, Capabilities],
        routes: tuple[Route, ...],
        rule: CallRule | None,
        groups: Mapping[str, Binding] | None = None,
        buckets: Mapping[Phase, tuple[str, tuple[int, ...], tuple[Binding, ...]]] | None = None,
    ) -> Binding:
        self = object.__new__(cls)
        put = object.__setattr__
        put(self, "spec", spec)
        put(self, "label", label)
        put(self, "backends", types.MappingProxyType(dict(backends)))
        put(self, "_config", config)
        put(self, "_caps", types.MappingProxyType(dict(caps)))
        put(self, "_routes", routes)
        # A bucketed phase has no handler of its own: resolve() finds it in the bucket's
        # binding, which attn_scope(runner, batch) makes the frame's.
        bucketed = buckets or {}
        put(
            self,
            "_handler_map",
            {p: r.handler for p, r in zip(Phase, routes, strict=False) if p not in bucketed},
        )
        put(self, "_buckets", types.MappingProxyType(dict(buckets)) if buckets else None)
        put(self, "_rule", rule)
        put(self, "_sm_scale", None if rule is None else rule.planned)
        put(self, "_groups", None if groups is None else types.MappingProxyType(dict(groups)))
        return self

    @classmethod
    def _grouped(cls, groups: dict[str, Binding], label: str | None) -> Binding:
        """A binding of groups: ``spec``, ``backends`` and the capabilities are the first
        group's (for display); each group's own are in ``groups``."""
        first = next(iter(groups.values()))
        return cls._make(first.spec, None, label, first.backends, first._caps, (), None, groups)

    @property
    def config(self) -> AttnConfig:
        """The bound ``AttnConfig`` (a grouped binding has one per group: ``configs``)."""
        if self._config is None:
            raise _grouped_error("config", self._groups or {}, attribute=True)
        return self._config

    @property
    def configs(self) -> Mapping[str, AttnConfig]:
        """Group -> that group's ``AttnConfig`` (empty for a binding made without groups)."""
        groups = self._groups or {}
        return types.MappingProxyType({n: g.config for n, g in groups.items()})

    @property
    def groups(self) -> Mapping[str, Binding]:
        """Group -> that group's Binding (empty for a binding made without groups)."""
        return self._groups if self._groups is not None else types.MappingProxyType({})

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Binding is immutable; cannot set {name!r} (bind a new one)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Binding is immutable; cannot delete {name!r}")

    @property
    def attn_binding(self) -> Binding:
        return self

    def route(self, phase: Phase, *, what: str = "route(phase)") -> Route:
        """How ``phase`` is served (backend, handler, form chooser)."""
        if self._groups is not None:
            raise _grouped_error(what, self._groups)
        phase = Phase.parse(phase)
        if self._buckets is not None and phase in self._buckets:
            raise _bucketed_error(self, phase, what)
        return self._routes[phase]

    @property
    def bucketed(self) -> bool:
        """Whether a phase of this binding picks its backend by the batch's shape."""
        return self._buckets is not None

    def for_batch(self, batch: Any) -> Binding:
        """The binding that serves ``batch``: this one, or for a phase with shape buckets the
        plain binding of the bucket the batch falls in (what ``attn_scope`` picks, once per
        forward). Its ``spec`` names the backend of each phase without buckets; its ``label``
        is this binding's."""
        if self._groups is not None:
            raise _grouped_error("for_batch(batch)", self._groups)
        if self._buckets is None:
            return self
        phase = getattr(batch, "phase", None)
        if type(phase) is not Phase:
            raise InvalidBatchError(
                "phase",
                f"batch {type(batch).__name__} has no Phase in .phase (got {phase!r}); map "
                "framework modes with phase_of()",
            )
        return self._pick(batch)

    def _pick(self, batch: Any) -> Binding:
        """The bucket's binding for ``batch`` (whose ``.phase`` is a Phase): one dict lookup,
        one attribute read and a scan of a few bounds, once per forward."""
        rule = self._buckets.get(batch.phase)  # type: ignore[union-attr]
        if rule is None:
            return self
        attr, bounds, bindings = rule
        try:
            value = getattr(batch, attr)
        except AttributeError:
            raise InvalidBatchError(
                attr,
                f"runner {self.label!r} picks its {batch.phase.name.lower()} backend by shape "
                f"({self.spec.phase_text(batch.phase)}), which reads the batch's {attr}; "
                f"batch {type(batch).__name__} has none",
            ) from None
        i = 0
        for bound in bounds:
            if value <= bound:
                return bindings[i]
            i += 1
        return bindings[i]

    def handler(self, phase: Phase) -> Handler:
        """The precomputed handler of ``phase`` (the call rules checked, then the backend's)."""
        return self.route(phase, what="handler(phase)").handler

    def backend(self, phase: Phase) -> AttentionBackend:
        """The backend object serving ``phase``."""
        return self.route(phase, what="backend(phase)").backend

    def backend_name(self, phase: Phase) -> str:
        return self.route(phase, what="backend_name(phase)").name

    def capabilities(self, name: str) -> Capabilities:
        """The capabilities this binding was checked against (a snapshot)."""
        return self._caps[name]

    def plan(self, batch: Any) -> Any:
        """Plan ``batch`` for the handler that will serve it (what ``attn_scope`` does)."""
        return self.prepare(batch)[0]

    def prepare(self, batch: Any) -> tuple[Any, Handler, AttnForm | None]:
        """``(plan, handler, form)`` for one forward: called once per scope with a batch."""
        plan, handler, _, form = self._prepare(batch)
        return plan, handler, form

    def _prepare(self, batch: Any) -> tuple[Any, Handler, Handler, AttnForm | None]:
        if self._groups is not None:
            raise _grouped_error("prepare(batch)", self._groups)
        phase = getattr(batch, "phase", None)
        if type(phase) is not Phase:
            raise InvalidBatchError(
                "phase",
                f"batch {type(batch).__name__} has no Phase in .phase (got {phase!r}); map "
                "framework modes with phase_of()",
            )
        if self._buckets is not None:
            return self._pick(batch)._routes[phase].prepare(batch)
        return self._routes[phase].prepare(batch)

    def _raw_of(self, phase: Phase, handler: Any) -> Handler | None:
        """The backend callable behind ``handler`` if ``handler`` is one this binding hands
        out for ``phase``, else None (a prepared plan from another binding)."""
        if self._buckets is not None and phase in self._buckets:
            return None  # only the bucket's own binding (attn_scope picks it first)
        route = self._routes[phase]
        if handler is route.handler:
            return route.raw
        for _, checked, raw in route.forms.values():
            if handler is checked:
                return raw
        return None

    def table(self) -> list[tuple[str, str]]:
        """``[(phase, backend), ...]`` for display (``q_len<=256:native|sdpa`` for buckets)."""
        return [(p.name.lower(), self.spec.phase_text(p)) for p in Phase]

    def __repr__(self) -> str:
        label = f"{self.label!r}, " if self.label is not None else ""
        if self._groups is not None:
            inner = ", ".join(f"{n}={b.spec!s}" for n, b in self._groups.items())
            return f"<Binding {label}groups: {inner}>"
        return f"<Binding {label}{self.spec!s} kind={self.config.kind!r}>"


def _bucketed_error(binding: Binding, phase: Phase, what: str) -> UsageError:
    return UsageError(
        f"Binding.{what}",
        f"phase {phase.name.lower()!r} of runner {binding.label!r} picks its backend by the "
        f"batch's shape ({binding.spec.phase_text(phase)}): ask the binding of the batch's "
        "bucket, binding.for_batch(batch), or open attn_scope(runner, batch)",
    )


def _grouped_error(
    what: str, groups: Mapping[str, Binding], *, attribute: bool = False
) -> UsageError:
    names = ", ".join(map(repr, groups))
    where = f"binding.groups[name].{what}"
    if attribute:
        where += f" (or binding.{what}s[name])"
    verb = "read" if attribute else "call"
    return UsageError(
        f"Binding.{what}",
        f"this binding has groups ({names}): {verb} {what} on one of them, {where}",
    )


@runtime_checkable
class Runner(Protocol):
    """Anything that owns a ``Binding``: a model runner, a draft worker, a wrapper."""

    @property
    def attn_binding(self) -> Binding: ...
