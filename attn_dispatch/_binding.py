"""bind(): check a spec against a config, build backends once, precompute handlers."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
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

    __slots__ = (
        "_backends",
        "_caps",
        "_choosers",
        "_form_table",
        "_handlers",
        "_phase_backends",
        "config",
        "label",
        "spec",
    )

    spec: BackendSpec
    config: AttnConfig
    label: str | None
    _handlers: tuple[Handler, Handler, Handler]
    _phase_backends: tuple[AttentionBackend, AttentionBackend, AttentionBackend]
    _backends: Mapping[str, AttentionBackend]
    _caps: Mapping[str, Capabilities]
    _choosers: tuple[Callable[[Any], AttnForm] | None, ...]
    _form_table: Mapping[tuple[Phase, AttnForm], tuple[AttentionBackend | None, Handler]]

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
        choosers: tuple[Callable[[Any], AttnForm] | None, ...] = (None, None, None),
        form_table: dict[tuple[Phase, AttnForm], tuple[AttentionBackend | None, Handler]]
        | None = None,
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
        put(self, "_choosers", choosers)
        put(self, "_form_table", types.MappingProxyType(dict(form_table or {})))
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
        """Plan ``batch`` for the handler that will serve it (what ``attn_scope`` does)."""
        return self.prepare(batch)[0]

    def prepare(self, batch: Any) -> tuple[Any, Handler, AttnForm | None]:
        """``(plan, handler, form)`` for one forward: called once per scope with a batch."""
        phase = batch.phase
        chooser = self._choosers[phase]
        form = None if chooser is None else chooser(batch)
        if form is None or form is AttnForm.MLA:
            return self._phase_backends[phase].plan(batch), self._handlers[phase], form
        backend, run = self._form_table[(phase, form)]
        if backend is None:  # MHA_CHUNKED plans from the batch itself
            return batch, run, form
        return backend.plan(batch.ragged()), run, form

    def form_for(self, batch: Any) -> AttnForm | None:
        """The form this binding's backend chooses for ``batch`` (None for MHA configs)."""
        chooser = self._choosers[batch.phase]
        return None if chooser is None else chooser(batch)

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
    choosers: tuple[Callable[[Any], AttnForm] | None, ...] = (None, None, None)
    form_table: dict[tuple[Phase, AttnForm], tuple[AttentionBackend | None, Handler]] = {}
    if config.kind == "mla":
        choosers, form_table = _bind_forms(spec, config, label, backends, caps, options)
    if "torch" in sys.modules and "attn_dispatch.compile" not in sys.modules:
        # Registers the op that lets torch.compile trace attention(); never imports torch itself.
        import attn_dispatch.compile  # noqa: F401
    return Binding._make(
        spec,
        config,
        label,
        backends,
        caps,
        handlers,  # type: ignore[arg-type]
        choosers,
        form_table,
    )


def _policy_of(backend: AttentionBackend, config: AttnConfig) -> FormPolicy | None:
    policy = getattr(backend, "form_policy", None)
    if policy is None:
        return None
    if not isinstance(policy, FormPolicy):
        raise InvalidSpecError("form_policy", policy, "a backend's form_policy is a FormPolicy")
    # A form the config cannot describe is never chosen (documented on FormPolicy).
    return policy if config.has_decompressed_form else FormPolicy.absorbed_only()


def _bind_forms(
    spec: BackendSpec,
    config: AttnConfig,
    label: str | None,
    backends: dict[str, AttentionBackend],
    caps: dict[str, Capabilities],
    options: Mapping[str, Mapping[str, Any]],
) -> tuple[
    tuple[Callable[[Any], AttnForm] | None, ...],
    dict[tuple[Phase, AttnForm], tuple[AttentionBackend | None, Handler]],
]:
    """Check every form each phase's policy can return; build the decompressed backends."""
    reasons: dict[Phase, tuple[str, list[str]]] = {}
    policies: dict[Phase, FormPolicy] = {}
    for phase in Phase:
        name = spec.names[phase]
        policy = _policy_of(backends[name], config)
        why: list[str] = []
        if policy is None:
            why.append(
                f"backend {name!r} declares no attention-form policy (form_policy) for MLA "
                "configs, so it cannot choose between the absorbed and decompressed forms"
            )
        else:
            policies[phase] = policy
            served = caps[name].forms_for(phase)
            for form in sorted(policy.possible(phase), key=lambda f: f.value):
                if form.value not in served:
                    why.append(
                        f"its form policy may choose {form.value!r} in this phase, which it does "
                        f"not serve (serves: {', '.join(sorted(map(repr, served))) or 'none'})"
                    )
                elif form is not AttnForm.MLA:
                    dcfg = config.decompressed()
                    why.extend(
                        f"decompressed form {form.value!r} ({dcfg.head_dim}/{dcfg.v_head_dim}): {r}"
                        for r in caps[name].reasons(dcfg, phase)
                    )
                    if form is AttnForm.MHA_CHUNKED and not hasattr(
                        backends[name], "chunked_handler"
                    ):
                        why.append(f"backend {name!r} has no chunked_handler for 'mha_chunked'")
        if why:
            reasons[phase] = (name, why)
    if reasons:
        raise IncompatibleBackendError(label, reasons, config=config)
    table: dict[tuple[Phase, AttnForm], tuple[AttentionBackend | None, Handler]] = {}
    decompressed: dict[str, AttentionBackend] = {}
    for phase, policy in policies.items():
        name = spec.names[phase]
        for form in policy.possible(phase) - {AttnForm.MLA}:
            if name not in decompressed:
                factory = get_backend(name).load_factory()
                decompressed[name] = factory(config.decompressed(), **options.get(name, {}))
            dbackend = decompressed[name]
            if form is AttnForm.MHA:
                table[(phase, form)] = (dbackend, _ragged(dbackend.handler(phase)))
            else:
                table[(phase, form)] = (None, dbackend.chunked_handler(phase))  # type: ignore[attr-defined]
    choosers = tuple(policies[p].choose if p in policies else None for p in Phase)
    return choosers, table


def _ragged(handler: Handler) -> Handler:
    """Serve ragged ``[rows, H, D]`` K/V through a paged handler with one token per page."""

    def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> Any:
        return handler(q, k.unsqueeze(1), v.unsqueeze(1), plan, sm_scale)

    return run
