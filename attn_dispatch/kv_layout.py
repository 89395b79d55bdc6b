"""KV layout descriptors: what a page of one binding's KV cache holds, and who may read it.

In disaggregated serving a prefill instance writes KV pages and a decode instance reads them,
often with other kernels, another tensor-parallel size or another build. Engines compare the
KV dtype only, so two FP8 layouts of different byte sizes both pass (SGLang 37838), and an
LSE's base (natural log or log2) differs between libraries (PyTorch 181645). A ``KVLayout``
says everything a reader must agree on, ``to_bytes``/``from_bytes`` carry it between
processes, and ``assert_kv_compatible(a, b)`` refuses, naming every difference, to hand pages
from one binding to another that would read them differently.

Torch-free: it reads configs and bindings, never tensors.

>>> from attn_dispatch import AttnConfig
>>> prefill = kv_layout(AttnConfig("mha", num_q_heads=8, num_kv_heads=2, head_dim=64,
...                                 dtype="bfloat16", kv_dtype="float8_e4m3fn", page_size=16))
>>> prefill.bytes_per_page  # K and V: 16 slots x 2 heads x (64 + 64) x 1 byte
4096
>>> KVLayout.from_bytes(prefill.to_bytes()) == prefill
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any
from typing import Literal

from attn_dispatch._dtypes import dtype_name
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._vocab import FP8_DTYPES
from attn_dispatch._vocab import KINDS

__all__ = [
    "FORMAT",
    "HEAD_LAYOUTS",
    "LSE_BASES",
    "MAX_BYTES",
    "SCALE_KINDS",
    "IncompatibleKVLayoutError",
    "InvalidKVLayoutError",
    "KVLayout",
    "assert_kv_compatible",
    "kv_differences",
    "kv_layout",
]

#: The first line of ``KVLayout.to_bytes()``: the format's name and version. A reader refuses
#: any other (a future version may add fields an old reader would silently drop).
FORMAT = b"attn_dispatch.kv_layout/1"
#: The largest encoding ``from_bytes`` reads: a descriptor is about 300 bytes; anything far
#: larger is not one (and is refused before it is parsed).
MAX_BYTES = 4096
#: Where a page's slots and heads lie: ``"NHD"`` is ``[page_size, heads, dim]`` per page
#: (attn_dispatch's, FlashInfer's default), ``"HND"`` is ``[heads, page_size, dim]``.
HEAD_LAYOUTS = ("NHD", "HND")
#: How an FP8 cache is scaled: ``"none"`` (not FP8), ``"per_tensor"`` (one float per layer
#: for K and one for V, attn_dispatch's), ``"per_token"`` and ``"per_block"`` (scales stored
#: with the pages, other engines' layouts).
SCALE_KINDS = ("none", "per_tensor", "per_token", "per_block")
#: The base of a returned log-sum-exp: ``"e"`` (natural log: attn_dispatch, vLLM with
#: ``is_lse_base_on_e``) or ``"2"`` (log2: some FlashAttention/FlashInfer paths).
LSE_BASES = ("e", "2")
# attn_dispatch's own (``attention(..., return_lse=True)``); attn_dispatch.distributed.LSE_BASE
# says the same (a test holds them equal; that module imports this one).
_LSE_BASE = "e"


class InvalidKVLayoutError(AttnDispatchError, ValueError):
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

    def __reduce__(self) -> tuple[Any, ...]:  # survives pickling across processes
        return (type(self), (self.field, self.value, self.problem))


class IncompatibleKVLayoutError(AttnDispatchError, ValueError):
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.differences,))


_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def _element_bytes(kind: str, page: int, heads: int, dim: int, v_dim: int, dtype: str) -> int:
    size = _ITEMSIZE[dtype]
    if kind == "mla":  # one latent row per slot; V is its first v_dim columns
        return page * dim * size
    return page * heads * (dim + v_dim) * size


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """What one page of a binding's KV cache holds, per layer (see the module doc).

    ``kind``: ``"mha"`` (separate K and V pages) or ``"mla"`` (one latent page; V is its
    first ``v_head_dim`` columns). ``page_size`` tokens per page; ``head_layout`` one of
    ``HEAD_LAYOUTS``; ``num_kv_heads`` the KV heads this instance holds (per rank);
    ``head_dim``/``v_head_dim`` the K and V widths; ``kv_dtype`` the stored dtype;
    ``scale_kind`` one of ``SCALE_KINDS``; ``bytes_per_page`` the bytes one page of one layer
    takes (K and V together), which a layout with scales or padding inside its pages makes
    larger than the element count says; ``lse_base`` one of ``LSE_BASES``.
    """

    kind: Literal["mha", "mla"]
    page_size: int
    head_layout: str
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_dtype: str
    scale_kind: str
    bytes_per_page: int
    lse_base: str = "e"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidKVLayoutError("kind", self.kind, f"choose one of {KINDS!r}")
        for name in ("page_size", "num_kv_heads", "head_dim", "v_head_dim", "bytes_per_page"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidKVLayoutError(name, v, "must be an int >= 1")
        for name, choices in (
            ("head_layout", HEAD_LAYOUTS),
            ("scale_kind", SCALE_KINDS),
            ("lse_base", LSE_BASES),
        ):
            if getattr(self, name) not in choices:
                raise InvalidKVLayoutError(name, getattr(self, name), f"choose one of {choices!r}")
        try:
            kv = dtype_name(self.kv_dtype, field="kv_dtype")
        except (TypeError, ValueError):
            kv = None
        if kv not in _ITEMSIZE:
            raise InvalidKVLayoutError(
                "kv_dtype", self.kv_dtype, f"choose one of {tuple(_ITEMSIZE)!r}"
            )
        object.__setattr__(self, "kv_dtype", kv)
        fp8 = kv in FP8_DTYPES
        if fp8 == (self.scale_kind == "none"):
            raise InvalidKVLayoutError(
                "scale_kind",
                self.scale_kind,
                f"an FP8 cache ({kv!r}) needs a scale kind other than 'none'"
                if fp8
                else f"a {kv!r} cache is not scaled: use 'none'",
            )
        if self.kind == "mla" and (self.num_kv_heads != 1 or self.v_head_dim >= self.head_dim):
            raise InvalidKVLayoutError(
                "num_kv_heads",
                (self.num_kv_heads, self.head_dim, self.v_head_dim),
                "an MLA page has one latent head and v_head_dim < head_dim",
            )
        least = self.element_bytes
        if self.bytes_per_page < least:
            raise InvalidKVLayoutError(
                "bytes_per_page",
                self.bytes_per_page,
                f"smaller than the {least} bytes its elements take",
            )

    @property
    def element_bytes(self) -> int:
        """The bytes the K/V elements of one page of one layer take (no scales, no padding)."""
        return _element_bytes(
            self.kind, self.page_size, self.num_kv_heads, self.head_dim, self.v_head_dim,
            self.kv_dtype,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        if not isinstance(data, Mapping):
            raise InvalidKVLayoutError("layout", data, "expected a mapping of field to value")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = [n for n in names if n not in data and n != "lse_base"]
        if unknown or missing:
            raise InvalidKVLayoutError(
                "layout",
                dict(data),
                f"unknown fields {unknown!r}, missing fields {missing!r}; fields are {names!r}",
            )
        return cls(**data)

    def to_bytes(self) -> bytes:
        """``FORMAT``, a newline, then the fields as canonical JSON (sorted keys, ASCII)."""
        body = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return FORMAT + b"\n" + body.encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> KVLayout:
        """Read ``to_bytes()``'s encoding; anything else raises ``InvalidKVLayoutError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidKVLayoutError("data", type(data).__name__, "expected bytes")
        raw = bytes(data)
        if len(raw) > MAX_BYTES:
            raise InvalidKVLayoutError(
                "data", f"{len(raw)} bytes", f"larger than {MAX_BYTES}: not a KV layout"
            )
        head, sep, body = raw.partition(b"\n")
        if not sep or head != FORMAT:
            raise InvalidKVLayoutError(
                "format",
                head[:64],
                f"expected {FORMAT!r} (another version or not a KV layout descriptor)",
            )
        try:
            fields = json.loads(body.decode("ascii"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8/ASCII or JSON
            raise InvalidKVLayoutError("data", body[:64], f"not ASCII JSON: {exc}") from None
        return cls.from_dict(fields)

    def fingerprint(self) -> str:
        """A short hash of ``to_bytes()``: equal layouts, equal fingerprints."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]


def kv_layout(source: Any, *, group: str | None = None) -> KVLayout:
    """The KV layout of a ``Binding`` (of ``group``, for a grouped one) or an ``AttnConfig``.

    attn_dispatch's caches are ``"NHD"`` pages with one float scale per layer for FP8
    (``"per_tensor"``), and its LSE is the natural log.
    """
    from attn_dispatch._config import AttnConfig

    config = source
    groups = getattr(source, "groups", None)
    if groups:
        if group not in groups:
            raise InvalidKVLayoutError(
                "group", group, f"this binding has groups {sorted(groups)!r}: name one"
            )
        config = groups[group].config
    elif group is not None:
        raise InvalidKVLayoutError("group", group, "this binding has no layer groups")
    else:
        config = getattr(source, "config", source)
    if not isinstance(config, AttnConfig):
        raise InvalidKVLayoutError(
            "source", type(source).__name__, "pass a Binding or an AttnConfig"
        )
    v_dim = config.v_head_dim
    assert v_dim is not None  # AttnConfig fills it in
    fp8 = config.kv_dtype in FP8_DTYPES
    kv = str(config.kv_dtype)
    return KVLayout(
        kind=config.kind,
        page_size=config.page_size,
        head_layout="NHD",
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        v_head_dim=v_dim,
        kv_dtype=kv,
        scale_kind="per_tensor" if fp8 else "none",
        # attn_dispatch's pages hold the elements only (scales are per-layer floats).
        bytes_per_page=_element_bytes(
            config.kind, config.page_size, config.num_kv_heads, config.head_dim, v_dim, kv
        ),
        lse_base=_LSE_BASE,
    )


def _as_layout(value: KVLayout | bytes | Any, name: str) -> KVLayout:
    if isinstance(value, KVLayout):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return KVLayout.from_bytes(bytes(value))
    try:
        return kv_layout(value)
    except InvalidKVLayoutError as exc:
        raise InvalidKVLayoutError(
            name, type(value).__name__, "pass a KVLayout, its bytes, a Binding or an AttnConfig"
        ) from exc


def kv_differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """Each field whose value differs between two layouts: ``{field: (a's, b's)}``.

    ``a`` and ``b`` are ``KVLayout``\\ s, their bytes, ``Binding``\\ s or ``AttnConfig``\\ s.
    """
    la, lb = _as_layout(a, "a"), _as_layout(b, "b")
    return {
        f.name: (getattr(la, f.name), getattr(lb, f.name))
        for f in dataclasses.fields(KVLayout)
        if getattr(la, f.name) != getattr(lb, f.name)
    }


def assert_kv_compatible(a: Any, b: Any) -> None:
    """Raise ``IncompatibleKVLayoutError`` naming every differing field, unless pages written
    under layout ``a`` read the same under layout ``b``.

    Every field counts: a page handed between two layouts that differ in any of them is read
    as other numbers (or out of its bounds), and nothing downstream can tell.
    """
    diffs = kv_differences(a, b)
    if diffs:
        raise IncompatibleKVLayoutError(diffs)
