"""bind(): check a spec against a config, build backends once, precompute handlers.

The checks (``check_spec``) are shared with ``python -m attn_dispatch explain``, which runs
them without building anything; the result types (``Binding``, ``Route``) are in
``attn_dispatch._route`` (imported here too: ``bind`` returns them).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from attn_dispatch._calls import CallRule
from attn_dispatch._calls import checked_handler
from attn_dispatch._config import VARIANTS
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import MEMBERS
from attn_dispatch._protocol import AttentionBackend
from attn_dispatch._protocol import BackendBase
from attn_dispatch._protocol import Handler
from attn_dispatch._registry import DEFAULT_REGISTRY
from attn_dispatch._registry import BackendEntry
from attn_dispatch._registry import Registry
from attn_dispatch._route import Binding
from attn_dispatch._route import Route
from attn_dispatch._spec import MEASURE_ATTRS
from attn_dispatch._spec import BackendSpec

__all__ = ["Binding", "CheckedSpec", "Route", "bind", "check_spec"]

#: Phase -> (backend name, reasons it cannot serve the config in that phase).
Reasons = dict[Phase, tuple[str, list[str]]]


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedSpec:
    """What ``check_spec`` found for one (group's) spec and config, before any factory runs:
    the registry entry of each name (looked up once), the form policy of each phase (MLA
    configs) and the factory keyword arguments of each backend."""

    spec: BackendSpec
    entries: Mapping[str, BackendEntry]
    policies: Mapping[Phase, FormPolicy]
    factory_options: Mapping[str, Mapping[str, Any]]
    #: A bucketed spec: (phase, bucket index) -> the check of that bucket's plain spec, the
    #: catch-all (index ``len(limits)``) included. Empty for a spec without buckets.
    buckets: Mapping[tuple[Phase, int], CheckedSpec] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )


def bind(
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    config: AttnConfig | Mapping[str, AttnConfig],
    *,
    label: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
) -> Binding:
    """Check ``spec`` against ``config`` for every phase, then build the backends.

    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
    ...                     dtype="float32", device="cpu", page_size=8)
    >>> binding = bind(BackendSpec.parse("prefill=torch,decode=native"), config, label="target")
    >>> binding.backend_name(Phase.DECODE)
    'native'
    >>> class Runner:                # any object with an ``attn_binding`` is a runner
    ...     attn_binding = binding

    Everything that can be checked is checked before any factory runs, and every reason of
    every phase is collected before one ``IncompatibleBackendError`` is raised; an unknown
    name raises ``UnknownBackendError``. ``options[name]`` are keyword arguments for that
    backend's factory, except ``"form_policy"`` (MLA configs), which the core reads itself: it
    overrides the policy the backend was registered with, for this binding only, and is not
    passed to the factory. A factory or backend that fails, or builds something that is not an
    ``AttentionBackend``, raises ``BackendUnavailableError`` naming the backend and the runner.
    Nothing is ever substituted. ``registry``: where the names are looked up (default: the
    process-wide one); each name is looked up once, so a re-registration during ``bind`` cannot
    mix two versions of a backend in one binding.

    Groups: a runner whose layers differ (sliding and full layers) binds one config per group,
    ``bind(spec, {"sliding": cfg_a, "full": cfg_b})``, with one spec for all or a mapping
    group -> spec; its layers call ``attention(..., group="sliding")``, and ``attn_scope``
    plans each group once per forward. Every group is checked before any factory runs.
    """
    if isinstance(config, Mapping):
        return _bind_groups(spec, config, label, options, registry)
    if isinstance(spec, Mapping):
        raise _specs_without_groups(spec)
    checked = check_spec(spec, config, label=label, options=options, registry=registry)
    return _build_checked(checked, config, label)


def _specs_without_groups(spec: Mapping[str, BackendSpec | str]) -> InvalidSpecError:
    return InvalidSpecError(
        "spec",
        dict(spec),
        "a mapping group -> spec needs a mapping group -> config too: "
        "bind({'sliding': s1, 'full': s2}, {'sliding': cfg_a, 'full': cfg_b})",
    )


def check(
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    config: AttnConfig | Mapping[str, AttnConfig],
    *,
    label: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
    machine: bool = True,
) -> dict[Phase, tuple[str, tuple[str, ...]]]:
    """Every reason ``bind`` would refuse ``spec`` for ``config`` with, without building any
    backend: empty when ``bind`` would pass its checks.

    >>> config = AttnConfig("mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
    ...                     dtype="float32", device="cuda")
    >>> check("prefill=torch,decode=native", config, machine=False)
    {<Phase.DECODE: 1>: ('native', ("device 'cuda' is not supported (supported: 'cpu')",))}
    >>> check("torch", config, machine=False)
    {}

    The same checks as ``bind``, so argument parsing can refuse a spec cheaply (no factory
    runs, nothing is imported beyond the backends' capabilities): the result maps each phase
    that cannot be served to ``(backend name, reasons)``, as ``IncompatibleBackendError.reasons``
    does. What ``bind`` refuses before checking capabilities still raises: a malformed spec or
    config (``InvalidSpecError``) and an unregistered name (``UnknownBackendError``). Groups
    (``config`` a mapping group -> config) are checked as ``bind`` checks them, each reason
    naming its group. ``machine=False`` leaves out what depends on this machine (modules,
    CUDA): the config checked as on a machine that has what each backend needs.

    A passing check does not promise that ``bind`` succeeds: a backend's factory may still fail
    when it builds (``BackendUnavailableError``).
    """
    try:
        if isinstance(config, Mapping):
            _check_groups(spec, config, label, options, registry, machine=machine)
        else:
            if isinstance(spec, Mapping):
                raise _specs_without_groups(spec)
            check_spec(
                spec, config, label=label, options=options, registry=registry, machine=machine
            )
    except IncompatibleBackendError as exc:
        return {phase: (name, tuple(why)) for phase, (name, why) in exc.reasons.items()}
    return {}


def check_spec(
    spec: BackendSpec | str,
    config: AttnConfig,
    *,
    label: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
    group: str | None = None,
    reasons: Reasons | None = None,
    machine: bool = True,
    _tag: str | None = None,
    _entries: Mapping[str, BackendEntry] | None = None,
) -> CheckedSpec:
    """Every check of ``bind`` (no factory runs): the one check ``bind`` and ``explain``
    share. A refusal raises ``IncompatibleBackendError`` with every reason of every phase;
    with ``reasons`` given, it is added there instead (each line prefixed with the group).
    ``machine=False`` checks only what the config decides (the same on every machine:
    ``explain --static``), not this machine's runtime (modules, CUDA). A spec with shape
    buckets is checked bucket by bucket: every backend of every bucket against the phase, every
    refusal listed (``_check_buckets``)."""
    if isinstance(spec, str):
        spec = BackendSpec.parse(spec)
    if not isinstance(spec, BackendSpec):
        raise InvalidSpecError("spec", spec, "pass a BackendSpec or a string such as 'torch'")
    if not isinstance(config, AttnConfig):
        raise InvalidSpecError("config", config, "pass an attn_dispatch.AttnConfig")
    if registry is None:
        registry = DEFAULT_REGISTRY
    elif not isinstance(registry, Registry):
        raise InvalidSpecError(
            "registry", registry, "pass an attn_dispatch.backend.Registry or None"
        )
    factory_options, override_policies = _split_options(spec, options)
    who = f"runner {label!r}" if label is not None else "bind"
    if group is not None:
        who += f", group {group!r}"
    # One lookup per name: everything below (checks, both factories) uses this entry.
    entries: dict[str, BackendEntry] = {}
    for phase in Phase:
        b = spec.buckets_for(phase)
        for name in (spec.names[phase], *(() if b is None else b.names)):
            if name not in entries:
                entries[name] = (
                    _entries[name]
                    if _entries is not None
                    else registry.get(name, context=f"{who}, phase {phase.name.lower()!r}")
                )
    if spec.buckets:
        return _check_buckets(
            spec, config, entries, label, options, registry, group, reasons, machine
        )
    found: dict[Phase, tuple[str, list[str]]] = {}
    for phase in Phase:
        name = spec.names[phase]
        caps = entries[name].capabilities
        why = caps.reasons(config, phase) if machine else caps.config_reasons(config, phase)
        if why:
            found[phase] = (name, why)
    policies: dict[Phase, FormPolicy] = {}
    if config.kind == "mla":
        policies = _check_forms(spec, config, entries, override_policies, found, machine=machine)
    if found:
        _add_served_by(config, entries, found, registry)
        if reasons is None:
            raise IncompatibleBackendError(label, found, config=config)
        tag = f"group {group!r}" if _tag is None else _tag
        for phase, (name, why) in found.items():
            # One error for all groups: each line names its group and that group's backend.
            head = reasons.setdefault(phase, (name, []))[0]
            who = tag if head == name or not tag else f"{tag} (backend {name!r})"
            reasons[phase][1].extend(f"{who}: {r}" if who else r for r in why)
    return CheckedSpec(spec, entries, policies, factory_options)


def _check_buckets(
    spec: BackendSpec,
    config: AttnConfig,
    entries: Mapping[str, BackendEntry],
    label: str | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    registry: Registry,
    group: str | None,
    reasons: Reasons | None,
    machine: bool,
) -> CheckedSpec:
    """A bucketed spec, checked as one plain spec per bucket (each bucket's backend on its
    phase, every other phase on its catch-all), every refusal of every bucket collected."""
    own: Reasons = {}
    where = "" if group is None else f"group {group!r}"
    opts = dict(options or {})

    def plain(sub: BackendSpec, tag: str) -> CheckedSpec:
        mine = {n: o for n, o in opts.items() if n in sub.names}
        return check_spec(
            sub, config, label=label, options=mine, registry=registry, group=group,
            reasons=own, machine=machine, _tag=tag, _entries=entries,
        )  # fmt: skip

    catch_all = dataclasses.replace(spec, buckets=())
    base = plain(catch_all, where)
    checks: dict[tuple[Phase, int], CheckedSpec] = {}
    for phase in Phase:
        b = spec.buckets_for(phase)
        if b is None:
            continue
        for i, (bound, _) in enumerate(b.limits):
            tag = f"bucket {b.measure}<={bound}"
            seen = {p: len(r) for p, (_, r) in own.items()}
            checks[(phase, i)] = plain(
                spec.bucket_spec(phase, i), f"{where}, {tag}" if where else tag
            )
            for other in Phase:  # only this bucket's phase: the others were checked above
                if other is not phase and other in own:
                    del own[other][1][seen.get(other, 0) :]
                    if not own[other][1]:
                        del own[other]
        checks[(phase, len(b.limits))] = base
    if own:
        if reasons is None:
            raise IncompatibleBackendError(label, own, config=config)
        for phase, (name, why) in own.items():
            reasons.setdefault(phase, (name, []))[1].extend(why)
    factory_options: dict[str, Mapping[str, Any]] = {}
    for c in checks.values():
        factory_options.update(c.factory_options)
    return CheckedSpec(
        spec, entries, base.policies, factory_options, types.MappingProxyType(checks)
    )


def _build_checked(
    checked: CheckedSpec,
    config: AttnConfig,
    label: str | None,
    group: str | None = None,
    built: Mapping[str, AttentionBackend] | None = None,
) -> Binding:
    if checked.buckets and built is None:
        return _build_buckets(checked, config, label, group)
    spec, entries, policies = checked.spec, checked.entries, checked.policies
    factory_options = checked.factory_options
    if built is not None:  # a bucket of a bucketed binding: the backends are shared
        entries = {n: entries[n] for n in spec.names}
    factories = {name: entry.load_factory(runner=label) for name, entry in entries.items()}
    backends = {
        name: (
            built[name]
            if built is not None
            else _build(name, factories[name], config, factory_options.get(name, {}), label)
        )
        for name in entries
    }
    rule = CallRule.of(config, label=label, group=group)
    caps = {name: entry.capabilities for name, entry in entries.items()}
    forms: dict[Phase, dict[AttnForm, tuple[AttentionBackend | None, Handler, Handler]]] = {}
    if policies:
        forms = _bind_forms(spec, config, label, policies, factories, factory_options, rule, caps)
    routes = []
    for phase in Phase:
        name = spec.names[phase]
        takes_out = caps[name].out_buffer
        raw = _handler_of(
            backends[name], name, phase, label, chunked=False, config=config, out=takes_out
        )
        policy = policies.get(phase)
        routes.append(
            Route(
                name=name,
                backend=backends[name],
                handler=checked_handler(raw, rule, name=name, takes_out=takes_out),
                raw=raw,
                chooser=None if policy is None else policy.choose,
                forms=types.MappingProxyType(forms.get(phase, {})),
            )
        )
    return Binding._make(spec, config, label, backends, caps, tuple(routes), rule)


def _build_buckets(
    checked: CheckedSpec, config: AttnConfig, label: str | None, group: str | None
) -> Binding:
    """Every backend built once, then one plain Binding per bucket sharing them; the runner's
    Binding picks one of them per forward (``Binding._pick``, at scope entry)."""
    spec, entries, options = checked.spec, checked.entries, checked.factory_options
    factories = {name: entry.load_factory(runner=label) for name, entry in entries.items()}
    built = {
        name: _build(name, factories[name], config, options.get(name, {}), label)
        for name in entries
    }
    subs = {
        key: _build_checked(sub, config, label, group, built)
        for key, sub in checked.buckets.items()
    }
    buckets: dict[Phase, tuple[str, tuple[int, ...], tuple[Binding, ...]]] = {}
    for phase in Phase:
        b = spec.buckets_for(phase)
        if b is not None:
            chosen = tuple(subs[(phase, i)] for i in range(len(b.limits) + 1))
            buckets[phase] = (MEASURE_ATTRS[b.measure], b.bounds, chosen)
    base = subs[next(iter(subs))] if not buckets else next(iter(buckets.values()))[2][-1]
    caps = {name: entry.capabilities for name, entry in entries.items()}
    return Binding._make(
        spec, config, label, built, caps, base._routes, base._rule, buckets=buckets
    )


def _bind_groups(
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    configs: Mapping[str, AttnConfig],
    label: str | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    registry: Registry | None,
) -> Binding:
    checked = _check_groups(spec, configs, label, options, registry)
    groups = {n: _build_checked(checked[n], configs[n], label, n) for n in checked}
    return Binding._grouped(groups, label)


def _check_groups(
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    configs: Mapping[str, AttnConfig],
    label: str | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    registry: Registry | None,
    *,
    machine: bool = True,
) -> dict[str, CheckedSpec]:
    """Every group checked before any factory runs: one ``IncompatibleBackendError`` with
    every reason of every group (each line names its group)."""
    names = list(configs)
    if not names:
        raise InvalidSpecError("config", {}, "a grouped binding needs at least one group")
    bad = [n for n in names if not isinstance(n, str) or not n.strip()]
    if bad:
        raise InvalidSpecError("config", bad, "group names must be non-empty strings")
    if isinstance(spec, Mapping):
        missing = [n for n in names if n not in spec]
        unknown = [n for n in spec if n not in configs]
        if missing or unknown:
            raise InvalidSpecError(
                "spec",
                dict(spec),
                f"the spec mapping must name the same groups as the configs ({names!r}); "
                f"missing: {missing!r}, unknown: {unknown!r}",
            )
        specs = {n: spec[n] for n in names}
    else:
        specs = dict.fromkeys(names, spec)
    reasons: Reasons = {}
    checked = {
        n: check_spec(
            specs[n],
            configs[n],
            label=label,
            options=options,
            registry=registry,
            group=n,
            reasons=reasons,
            machine=machine,
        )
        for n in names
    }
    if reasons:
        raise IncompatibleBackendError(label, reasons, config=dict(configs))
    return checked


def _add_served_by(
    config: AttnConfig,
    entries: Mapping[str, BackendEntry],
    reasons: dict[Phase, tuple[str, list[str]]],
    registry: Registry,
) -> None:
    """Name, for every variant or FP8 cache a phase's backend refuses, the registered backends
    that serve it for this config in that phase (so the refusal says what to bind instead)."""
    others: dict[str, BackendEntry] | None = None
    for phase, (name, why) in reasons.items():
        missing = entries[name].capabilities.missing(config, phase)
        if not missing:
            continue
        if others is None:
            others = registry.entries()
        for what in missing:
            served = [
                n
                for n, e in others.items()
                if n != name and what not in e.capabilities.missing(config, phase)
            ]
            label = f"variant {what!r}" if what in VARIANTS else f"kv_dtype {what!r}"
            why.append(
                f"{label} is served in phase {phase.name.lower()!r} by: "
                f"{', '.join(map(repr, served)) if served else 'no registered backend'}"
            )


def _split_options(
    spec: BackendSpec, options: Mapping[str, Mapping[str, Any]] | None
) -> tuple[dict[str, dict[str, Any]], dict[str, FormPolicy]]:
    """Factory keyword arguments per backend, and the form policies the options override."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise InvalidSpecError("options", options, "pass a mapping backend name -> {option: value}")
    unknown_opts = set(options) - set(spec.all_names)
    if unknown_opts:
        raise InvalidSpecError(
            "options",
            sorted(unknown_opts),
            f"options name backends the spec does not use (it uses {sorted(spec.all_names)!r})",
        )
    factory_options: dict[str, dict[str, Any]] = {}
    policies: dict[str, FormPolicy] = {}
    for name, opts in options.items():
        if not isinstance(opts, Mapping):
            raise InvalidSpecError(
                f"options[{name!r}]", opts, "pass a mapping of keyword arguments for the factory"
            )
        rest = dict(opts)
        if "form_policy" in rest:
            policy = rest.pop("form_policy")
            if not isinstance(policy, FormPolicy):
                raise InvalidSpecError(
                    f"options[{name!r}]['form_policy']",
                    policy,
                    "pass an attn_dispatch.backend.FormPolicy",
                )
            policies[name] = policy
        factory_options[name] = rest
    return factory_options, policies


def _unavailable(name: str, label: str | None, what: str, exc: BaseException) -> Exception:
    return BackendUnavailableError(name, f"{what}: {type(exc).__name__}: {exc}", runner=label)


def _build(
    name: str,
    factory: Callable[..., Any],
    config: AttnConfig,
    options: Mapping[str, Any],
    label: str | None,
    *,
    what: str = "its factory",
) -> AttentionBackend:
    try:
        backend = factory(config, **options)
    except AttnDispatchError:
        raise  # already ours, with its own context (a bad option, say)
    except Exception as exc:
        raise _unavailable(name, label, f"{what} failed", exc) from exc
    if backend is None or not isinstance(backend, AttentionBackend):
        missing = [m for m in MEMBERS if not hasattr(backend, m)]
        raise BackendUnavailableError(
            name,
            f"{what} returned {type(backend).__name__}, which is not an AttentionBackend "
            f"(missing: {', '.join(missing)}); subclass attn_dispatch.backend.BackendBase and "
            "define name, plan(batch) and handler(phase)",
            runner=label,
        )
    if isinstance(backend, BackendBase) and type(backend).plan is BackendBase.plan:
        # Caught here, not at the first attn_scope: the base's plan() only raises.
        raise BackendUnavailableError(
            name,
            f"{what} returned {type(backend).__name__}, which subclasses BackendBase but "
            "defines no plan(batch); define plan(batch) (the per-forward metadata)",
            runner=label,
        )
    return backend


def _handler_of(
    backend: AttentionBackend,
    name: str,
    phase: Phase,
    label: str | None,
    *,
    chunked: bool,
    config: AttnConfig,
    out: bool = False,
) -> Handler:
    what = f"{'chunked_handler' if chunked else 'handler'}({phase.name})"
    try:
        run = backend.chunked_handler(phase) if chunked else backend.handler(phase)
    except AttnDispatchError:
        raise
    except Exception as exc:
        raise _unavailable(name, label, f"{what} failed", exc) from exc
    if not callable(run):
        raise BackendUnavailableError(
            name, f"{what} returned {type(run).__name__}, which is not callable", runner=label
        )
    missing = _missing_keywords(run, config, out=out)
    if missing:
        raise BackendUnavailableError(
            name,
            f"{what} takes no {', '.join(f'{k}=' for k in missing)} keyword, but the bound "
            f"config needs it (sinks={config.sinks}, kv_dtype={config.kv_dtype!r}, "
            f"return_lse={config.return_lse}, Capabilities.out_buffer={out}) and its "
            f"Capabilities declare it; give the handler keyword-only parameters "
            f"{', '.join(missing)} (see attn_dispatch.backend.Handler)",
            runner=label,
        )
    return run  # type: ignore[return-value]


def _missing_keywords(
    run: Callable[..., Any], config: AttnConfig, *, out: bool = False
) -> list[str]:
    """The per-call keywords the config makes the core pass that ``run`` cannot take
    (``return_lse`` for an lse config: any of its calls may ask for the state; ``out`` for a
    backend that declares ``Capabilities.out_buffer``)."""
    need = []
    if config.sinks:
        need.append("sinks")
    if config.kv_fp8:
        need.append("k_scale")
        if config.kind != "mla":
            need.append("v_scale")
    if config.return_lse:
        need.append("return_lse")
    if out:
        need.append("out")
    if not need:
        return []
    try:
        params = inspect.signature(run).parameters
    except (TypeError, ValueError):  # no signature to read (a C callable): trust it
        return []
    kinds = inspect.Parameter
    if any(p.kind is kinds.VAR_KEYWORD for p in params.values()):
        return []
    takes = {
        n for n, p in params.items() if p.kind in (kinds.KEYWORD_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    }
    return [k for k in need if k not in takes]


def _check_forms(
    spec: BackendSpec,
    config: AttnConfig,
    entries: Mapping[str, BackendEntry],
    overrides: Mapping[str, FormPolicy],
    reasons: dict[Phase, tuple[str, list[str]]],
    *,
    machine: bool = True,
) -> dict[Phase, FormPolicy]:
    """Every form each phase's policy can return must be served: checked from the registry
    entries and options alone, before any factory runs. Adds to ``reasons`` (with
    ``machine=False``, only what the config decides: ``explain --static``)."""
    policies: dict[Phase, FormPolicy] = {}
    for phase in Phase:
        name = spec.names[phase]
        entry = entries[name]
        policy = overrides.get(name, entry.form_policy)
        if policy is None or not config.has_decompressed_form or config.kv_fp8:
            # A form the config cannot describe is never chosen (documented on FormPolicy).
            # An FP8 latent cache is read in the absorbed form only: the decompressed forms
            # run on K/V the model decompresses itself, which carry no cache scales.
            policy = FormPolicy.absorbed_only()
        policies[phase] = policy
        served = entry.capabilities.forms_for(phase)
        why: list[str] = []
        for form in sorted(policy.possible(phase), key=lambda f: f.value):
            if form.value not in served:
                why.append(
                    f"its form policy may choose {form.value!r} in this phase, which it does "
                    f"not serve (serves: {', '.join(sorted(map(repr, served))) or 'none'})"
                )
            elif form is not AttnForm.MLA:
                dcfg = config.decompressed()
                caps = entry.capabilities
                found = caps.reasons(dcfg, phase) if machine else caps.config_reasons(dcfg, phase)
                why.extend(
                    f"decompressed form {form.value!r} ({dcfg.head_dim}/{dcfg.v_head_dim}): {r}"
                    for r in found
                )
        if why:
            reasons.setdefault(phase, (name, []))[1].extend(why)
    return policies


def _bind_forms(
    spec: BackendSpec,
    config: AttnConfig,
    label: str | None,
    policies: Mapping[Phase, FormPolicy],
    factories: Mapping[str, Callable[..., Any]],
    options: Mapping[str, Mapping[str, Any]],
    rule: CallRule,
    caps: Mapping[str, Any],
) -> dict[Phase, dict[AttnForm, tuple[AttentionBackend | None, Handler, Handler]]]:
    """Build the decompressed-form backends (same factory as the absorbed one): phase ->
    form -> ``(backend or None, handler, raw)``. The ``MHA_CHUNKED`` handler is never passed
    ``out=`` (it merges its chunks into a fresh tensor): a call with ``out=`` gets the result
    copied there; the ``MHA`` form's paged handler takes it when its backend declares
    ``out_buffer``."""
    table: dict[Phase, dict[AttnForm, tuple[AttentionBackend | None, Handler, Handler]]] = {}
    decompressed: dict[str, AttentionBackend] = {}
    dcfg = config.decompressed() if config.has_decompressed_form else config
    for phase, policy in policies.items():
        name = spec.names[phase]
        for form in sorted(policy.possible(phase) - {AttnForm.MLA}, key=lambda f: f.value):
            if name not in decompressed:
                decompressed[name] = _build(
                    name,
                    factories[name],
                    dcfg,
                    options.get(name, {}),
                    label,
                    what="its factory for the decompressed form",
                )
            dbackend = decompressed[name]
            chunked = form is not AttnForm.MHA
            takes_out = not chunked and caps[name].out_buffer
            run = _handler_of(
                dbackend, name, phase, label, chunked=chunked, config=dcfg, out=takes_out
            )
            if not chunked:
                run = _ragged(run)
            table.setdefault(phase, {})[form] = (
                None if chunked else dbackend,
                checked_handler(
                    run, rule, name=name, takes_out=takes_out, out_dim=dcfg.out_head_dim
                ),
                run,
            )
    return table


def _ragged(handler: Handler) -> Handler:
    """Serve ragged ``[rows, H, D]`` K/V through a paged handler with one token per page."""

    def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float, **extras: Any) -> Any:
        return handler(q, k.unsqueeze(1), v.unsqueeze(1), plan, sm_scale, **extras)

    return run
