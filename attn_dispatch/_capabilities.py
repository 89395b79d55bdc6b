"""Capabilities: what one backend can serve.

Building one validates its fields (``InvalidSpecError``); checking a config against it
(``reasons``) never raises: it returns every mismatch as a sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import types
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._dtypes import dtype_name
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._vocab import FORMS
from attn_dispatch._vocab import KINDS
from attn_dispatch._vocab import VARIANTS

if TYPE_CHECKING:
    from attn_dispatch._config import AttnConfig

CheckFn = Callable[["AttnConfig", Phase], Iterable[str]]
AvailabilityFn = Callable[[], Iterable[str]]

ALL_PHASES = frozenset(Phase)
# The default of ``kinds``, refused on construction: it must be declared.
_UNDECLARED: frozenset[str] = frozenset()


def _members(field: str, values: object) -> list[object]:
    """The items of a set-valued field; a lone string or number is refused, not split."""
    if isinstance(values, (str, bytes, int, float)) or not isinstance(values, Iterable):
        raise InvalidSpecError(
            field,
            values,
            f"{field} is a set of values (e.g. {field}={{{values!r}}}), not a single "
            f"{type(values).__name__}",
        )
    return list(values)


def _strings(field: str, values: object) -> frozenset[str]:
    items = _members(field, values)
    bad = [v for v in items if not isinstance(v, str) or not v.strip()]
    if bad:
        raise InvalidSpecError(field, values, f"every item must be a non-empty str; got {bad!r}")
    return frozenset(str(v).strip().lower() for v in items)


def _names(field: str, values: object) -> frozenset[str]:
    return frozenset(dtype_name(v, field=field) for v in _members(field, values))


def _positive_ints(field: str, values: object) -> frozenset[int]:
    items = _members(field, values)
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        raise InvalidSpecError(field, values, f"every item must be a positive int; got {bad!r}")
    return frozenset(int(v) for v in items)  # type: ignore[call-overload]


def _callables(field: str, values: object) -> tuple[Callable[..., Iterable[str]], ...]:
    if callable(values):
        raise InvalidSpecError(
            field, values, f"{field} is a tuple of functions; wrap a single one: ({values!r},)"
        )
    items = _members(field, values)
    bad = [v for v in items if not callable(v)]
    if bad:
        raise InvalidSpecError(field, values, f"every item must be callable; got {bad!r}")
    return tuple(items)  # type: ignore[arg-type]


def _phases(values: object) -> frozenset[Phase]:
    from attn_dispatch._errors import UnknownPhaseError

    try:
        return frozenset(Phase.parse(p) for p in _members("phases", values))  # type: ignore[arg-type]
    except UnknownPhaseError as exc:
        raise InvalidSpecError("phases", values, str(exc)) from None


_KINDS = frozenset(KINDS)
_FORMS = FORMS
_VARIANTS = frozenset(VARIANTS)


def _known(what: str, known: frozenset[str]) -> Callable[[str, object], frozenset[str]]:
    """A parser of a set of names from ``known`` (variants, forms)."""

    def parse(field: str, values: object) -> frozenset[str]:
        names = _strings(field, values)
        if not names <= known:
            raise InvalidSpecError(
                field,
                values,
                f"unknown {what} {sorted(names - known)!r}; choose from {sorted(known)!r}",
            )
        return names

    return parse


_variants = _known("variants", _VARIANTS)
_forms = _known("forms", _FORMS)


def _per_phase(
    field: str,
    values: AbstractSet[str] | Mapping[Phase | str, AbstractSet[str]],
    parse: Callable[[str, object], frozenset[str]],
) -> tuple[AbstractSet[str] | Mapping[Phase, frozenset[str]], tuple[frozenset[str], ...]]:
    """A set for every phase, or a mapping phase -> set: (the stored value, one set per phase)."""
    if isinstance(values, Mapping):
        by_phase = {Phase.parse(p): parse(f"{field}[{p!r}]", fs) for p, fs in values.items()}
        per = tuple(by_phase.get(p, frozenset()) for p in Phase)
        return types.MappingProxyType(dict(zip(Phase, per, strict=True))), per
    one = parse(field, values)
    return one, (one,) * len(Phase)


def _variant_detail(config: AttnConfig, variant: str) -> str:
    if variant == "window":
        return f"window_left={config.window_left!r}"
    if variant == "logit_cap":
        return f"logit_cap={config.logit_cap!r}"
    if variant == "non_causal":
        return "causal=False"
    if variant == "chunked":
        return f"attention_chunk_size={config.attention_chunk_size!r}"
    if variant == "lse":
        return "return_lse=True"
    return "sinks=True"


def _fmt(values: Iterable[object]) -> str:
    return ", ".join(repr(v) for v in sorted(values, key=str))


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can serve; ``reasons(config, phase)`` lists every mismatch.

    >>> from attn_dispatch import AttnConfig, Phase
    >>> caps = Capabilities(kinds={"mha"}, devices={"cpu"}, dtypes={"float32"})
    >>> caps.reasons(AttnConfig("mla", 16, 1, 576, 512, dtype="float32"), Phase.DECODE)
    ["kind 'mla' is not supported (supported: 'mha')"]

    ``None`` for a dims/page-size field means "any". ``forms`` are the attention forms (see
    ``AttnForm``) this backend serves for MLA configs: one set for every phase, or a mapping
    phase -> set; declaring ``"mha_chunked"`` means the backend object has a
    ``chunked_handler``. ``plans_scale``: the backend fixes the softmax scale when it plans
    (FlashInfer's wrappers), so a config must carry ``sm_scale``. ``variants``: the layer
    variants served (``"window"``, ``"logit_cap"``, ``"sinks"``, and the attention types
    ``"non_causal"``, ``"chunked"``; see ``AttnConfig``), one set
    for every phase or a mapping phase -> set, like ``forms``; a backend that declares none
    serves none. FP8 caches are declared in ``kv_dtypes`` (``"float8_e4m3fn"``,
    ``"float8_e5m2"``). A field given the wrong shape (``kinds="mha"`` instead of
    ``{"mha"}``) raises ``InvalidSpecError``. ``kinds`` is required; ``custom_mask`` (tree
    verify) is off unless declared. ``out_buffer``: the backend's handlers take ``out=`` (a
    caller's output buffer) and write the result there (``attention(..., out=buf)``; see
    ``attn_dispatch.backend.Handler``); ``bind`` checks their signatures for it. Undeclared,
    ``attention(..., out=buf)`` still fills ``buf``: the core copies the handler's result into
    it. A value of ``Capabilities`` pickles (its checks pickle as references to their
    functions).
    """

    # Required: a backend says which kinds of layer it serves (a default of both let a
    # backend that declares nothing bind MLA). Left out, it is refused with InvalidSpecError
    # naming the choices, not with the dataclass's bare TypeError.
    kinds: AbstractSet[str] = _UNDECLARED
    phases: AbstractSet[Phase] = ALL_PHASES
    devices: AbstractSet[str] = frozenset({"cpu"})
    dtypes: AbstractSet[str] = frozenset({"float32", "float16", "bfloat16"})
    kv_dtypes: AbstractSet[str] | None = None
    head_dims: AbstractSet[int] | None = None
    v_head_dims: AbstractSet[int] | None = None
    page_sizes: AbstractSet[int] | None = None
    # Off unless declared: tree verify binds only to a backend that says it takes the mask.
    custom_mask: bool = False
    plans_scale: bool = False
    # Off unless declared: the handlers write into a caller's buffer (``out=``) themselves;
    # for a backend that does not declare it the core copies the result into the buffer.
    out_buffer: bool = False
    requires: tuple[str, ...] = ()
    min_compute_capability: tuple[int, int] | None = None
    checks: tuple[CheckFn, ...] = ()
    availability: tuple[AvailabilityFn, ...] = ()
    # Compared through _forms_by_phase (a mapping is not hashable).
    forms: AbstractSet[str] | Mapping[Phase | str, AbstractSet[str]] = dataclasses.field(
        default=frozenset({"mla"}), compare=False
    )
    description: str = ""
    variants: AbstractSet[str] | Mapping[Phase | str, AbstractSet[str]] = dataclasses.field(
        default=frozenset(), compare=False
    )
    _forms_by_phase: tuple[frozenset[str], ...] = dataclasses.field(
        init=False, repr=False, default=()
    )
    _variants_by_phase: tuple[frozenset[str], ...] = dataclasses.field(
        init=False, repr=False, default=()
    )

    def __post_init__(self) -> None:
        # Accept any iterables (sets, lists) and store immutable, hashable values; a str
        # where a set belongs would otherwise become a set of its characters.
        put = object.__setattr__
        if self.kinds is _UNDECLARED or not self.kinds:
            raise InvalidSpecError(
                "kinds",
                None if self.kinds is _UNDECLARED else self.kinds,
                "declare the kinds of layer this backend serves: kinds={'mha'}, {'mla'} or "
                "{'mha', 'mla'} (there is no default)",
            )
        put(self, "kinds", _strings("kinds", self.kinds))
        if not self.kinds <= _KINDS:
            raise InvalidSpecError(
                "kinds",
                self.kinds,
                f"unknown kinds {sorted(self.kinds - _KINDS)!r}; choose from 'mha', 'mla'",
            )
        put(self, "phases", _phases(self.phases))
        put(self, "devices", _strings("devices", self.devices))
        put(self, "dtypes", _names("dtypes", self.dtypes))
        if self.kv_dtypes is not None:
            put(self, "kv_dtypes", _names("kv_dtypes", self.kv_dtypes))
        for field in ("head_dims", "v_head_dims", "page_sizes"):
            value = getattr(self, field)
            if value is not None:
                put(self, field, _positive_ints(field, value))
        for field in ("custom_mask", "plans_scale", "out_buffer"):
            if not isinstance(getattr(self, field), bool):
                raise InvalidSpecError(field, getattr(self, field), "must be a bool")
        _strings("requires", self.requires)  # validates; module names keep their case
        put(self, "requires", tuple(str(m).strip() for m in self.requires))
        put(self, "checks", _callables("checks", self.checks))
        put(self, "availability", _callables("availability", self.availability))
        cc = self.min_compute_capability
        if cc is not None and (
            not isinstance(cc, tuple)
            or len(cc) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cc)
        ):
            raise InvalidSpecError(
                "min_compute_capability", cc, "must be None or (major, minor), e.g. (8, 0)"
            )
        stored, per = _per_phase("forms", self.forms, _forms)
        put(self, "forms", stored)
        put(self, "_forms_by_phase", per)
        stored, per = _per_phase("variants", self.variants, _variants)
        put(self, "variants", stored)
        put(self, "_variants_by_phase", per)

    def forms_for(self, phase: Phase) -> frozenset[str]:
        """The attention forms (``AttnForm`` values) this backend serves in ``phase``."""
        return self._forms_by_phase[phase]

    def variants_for(self, phase: Phase) -> frozenset[str]:
        """The layer variants (``"window"``, ``"logit_cap"``, ``"sinks"``, ...) served in
        ``phase``."""
        return self._variants_by_phase[phase]

    def missing(self, config: AttnConfig, phase: Phase) -> list[str]:
        """What ``config`` uses of the variants and FP8 caches that is not served in ``phase``:
        variant names, plus the FP8 ``kv_dtype`` name when that is refused."""
        out = sorted(config.variants - self._variants_by_phase[phase])
        kv_ok = self.dtypes if self.kv_dtypes is None else self.kv_dtypes
        if config.kv_fp8 and config.kv_dtype not in kv_ok:
            out.append(str(config.kv_dtype))
        return out

    def availability_reasons(self, device: str | None = None) -> list[str]:
        """Why the backend cannot run here at all (empty when it can)."""
        reasons = [
            f"module {mod!r} is not installed (pip install {mod.replace('_', '-')})"
            for mod in self.requires
            if not _importable(mod)
        ]
        for fn in self.availability:
            reasons.extend(_safe(fn))
        if device is None and self.devices == {"cuda"}:
            # Asked without a config (e.g. `list`): a CUDA-only backend needs CUDA here.
            reasons.extend(_cuda_reasons("cuda", self.min_compute_capability))
        return reasons

    def reasons(self, config: AttnConfig, phase: Phase) -> list[str]:
        """Every reason this backend cannot serve ``config`` in ``phase`` (empty when it can):
        ``config_reasons`` followed by ``machine_reasons``."""
        return self.config_reasons(config, phase) + self.machine_reasons(config)

    def machine_reasons(self, config: AttnConfig) -> list[str]:
        """What keeps the backend from running ``config`` on *this* machine: a required module
        that is not importable, the backend's availability checks, no CUDA, a GPU below
        ``min_compute_capability``. Empty on a machine that has all it needs."""
        dev = config.device_type
        out = self.availability_reasons(dev)
        if dev == "cuda" and dev in self.devices:
            out.extend(_cuda_reasons(config.device, self.min_compute_capability))
        return out

    def config_reasons(self, config: AttnConfig, phase: Phase) -> list[str]:
        """What the config itself asks for that the backend does not serve (kind, phase,
        device type, dtypes, dims, page size, tree mask, scale, the backend's own checks):
        the same on every machine, so a config for another machine can be checked here."""
        out: list[str] = []
        if phase not in self.phases:
            out.append(
                f"phase {phase.name.lower()!r} is not implemented "
                f"(implemented: {_fmt(p.name.lower() for p in self.phases)})"
            )
        if config.kind not in self.kinds:
            out.append(f"kind {config.kind!r} is not supported (supported: {_fmt(self.kinds)})")
        dev = config.device_type
        if dev not in self.devices:
            out.append(
                f"device {config.device!r} is not supported (supported: {_fmt(self.devices)})"
            )
        if config.dtype not in self.dtypes:
            out.append(f"dtype {config.dtype!r} is not supported (supported: {_fmt(self.dtypes)})")
        kv_ok = self.dtypes if self.kv_dtypes is None else self.kv_dtypes
        if config.kv_dtype not in kv_ok:
            out.append(f"kv_dtype {config.kv_dtype!r} is not supported (supported: {_fmt(kv_ok)})")
        for variant in sorted(config.variants - self._variants_by_phase[phase]):
            served = self._variants_by_phase[phase]
            out.append(
                f"layer variant {variant!r} ({_variant_detail(config, variant)}) is not "
                f"implemented in phase {phase.name.lower()!r} (this backend serves: "
                f"{_fmt(served) or 'no variants'})"
            )
        if self.head_dims is not None and config.head_dim not in self.head_dims:
            out.append(
                f"head_dim {config.head_dim!r} is not supported (supported: {_fmt(self.head_dims)})"
            )
        if self.v_head_dims is not None and config.v_head_dim not in self.v_head_dims:
            out.append(
                f"v_head_dim {config.v_head_dim!r} is not supported "
                f"(supported: {_fmt(self.v_head_dims)})"
            )
        if self.page_sizes is not None and config.page_size not in self.page_sizes:
            out.append(
                f"page_size {config.page_size!r} is not supported "
                f"(supported: {_fmt(self.page_sizes)})"
            )
        if self.plans_scale and config.sm_scale is None:
            out.append(
                "this backend fixes the softmax scale when it plans (once per forward), so the "
                "config must carry it: set AttnConfig(sm_scale=...) (e.g. head_dim ** -0.5; "
                "the scale the layers pass to attention())"
            )
        if phase is Phase.VERIFY and config.tree_verify and not self.custom_mask:
            out.append(
                "tree verify needs a custom attention mask, which this backend does not support"
            )
        for check in self.checks:
            out.extend(_safe(check, config, phase))
        return out

    def replace(self, **changes: object) -> Capabilities:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt through the constructor from its own fields: a per-phase mapping is stored
        # as a read-only mappingproxy, which pickle refuses (native, triton, flashinfer).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in ("forms", "variants"):
            if isinstance(fields[name], Mapping):
                fields[name] = dict(fields[name])
        # A partial of the public class: the pickle names no private module.
        return (functools.partial(type(self), **fields), ())


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _safe(fn: Callable[..., Iterable[str]], *args: object) -> list[str]:
    # A check is user code: a bug in it must become a reason, not a crash inside bind.
    try:
        result = fn(*args)
        # A check that returns one string means one reason, not one reason per character.
        if isinstance(result, str):
            return [result]
        return [str(r) for r in result]
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        return [f"capability check {name} failed: {type(exc).__name__}: {exc}"]


def _cuda_reasons(device: str, minimum: tuple[int, int] | None) -> list[str]:
    if not _importable("torch"):
        return ["needs CUDA: torch is not installed"]
    import torch

    if not torch.cuda.is_available():
        return ["needs CUDA: torch.cuda.is_available() is False on this machine"]
    try:
        cc = torch.cuda.get_device_capability(device)
    except Exception as exc:
        return [f"cannot query CUDA device {device!r}: {exc}"]
    if minimum is not None and tuple(cc) < minimum:
        return [
            f"needs compute capability >= sm{minimum[0]}{minimum[1]}, "
            f"device {device!r} is sm{cc[0]}{cc[1]}"
        ]
    return []
