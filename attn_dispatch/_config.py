"""AttnConfig: what the attention layers of one runner look like."""

from __future__ import annotations

import dataclasses
from typing import Any

from attn_dispatch._dtypes import device_type
from attn_dispatch._dtypes import dtype_name
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._values import int_problem
from attn_dispatch._values import positive_f32_problem
from attn_dispatch._vocab import FP8_DTYPES
from attn_dispatch._vocab import KINDS
from attn_dispatch._vocab import VARIANTS as VARIANTS
from attn_dispatch._vocab import Kind


@dataclasses.dataclass(frozen=True, slots=True)
class AttnConfig:
    """The shape of one runner's attention layers, checked against backend capabilities.

    >>> AttnConfig(kind="mla", num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
    ...            dtype="bfloat16", page_size=64, device="cuda")  # doctest: +ELLIPSIS
    AttnConfig(kind='mla', ...)

    For ``kind="mla"`` the dims describe the absorbed form (q/k = latent + rope, v = latent).
    ``mha_head_dim``/``mha_v_head_dim`` optionally describe the decompressed MHA form of the
    same layers (DeepSeek: 192/128, with ``num_q_heads`` heads), which prefill may use.

    ``sm_scale`` (finite, > 0) is the softmax scale of every layer, planned with the batch:
    ``attention(...)`` then needs no ``sm_scale`` argument (one given must equal it), and
    backends that fix the scale when they plan (FlashInfer) can be bound. ``None`` (the
    default) means each call passes its own ``sm_scale``.

    Layer variants (see docs/guides/variants.md): ``window_left`` (int >= 0;
    a query at position p sees keys p - window_left ..= p; None = full attention; HF's
    ``sliding_window = W`` is ``window_left = W - 1``), ``logit_cap`` (finite > 0: scores are
    ``cap * tanh(q.k * sm_scale / cap)``; None or 0.0 = off, stored as None) and ``sinks``
    (one learned sink logit per query head, passed per call: ``attention(..., sinks=t)``).
    ``kv_dtype`` is the compute ``dtype`` (the default) or an FP8 format,
    ``"float8_e4m3fn"``/``"float8_e5m2"``: the cache then holds ``K / k_scale`` and
    ``V / v_scale``, with the scales passed per call (``attention(..., k_scale=, v_scale=)``).

    Attention types (declared by backends as the variants ``"non_causal"`` and
    ``"chunked"``): ``causal=False`` makes prefill and verify attend to every key of the
    request (encoders, vision towers; decode is unchanged); ``attention_chunk_size=C``
    (int >= 1, Llama 4's chunked local attention) lets a query at position p see keys
    ``(p // C) * C ..= p`` only (with a window too, both bounds apply). A non-causal config
    takes no window or chunk.

    ``return_lse=True`` (declared by backends as the variant ``"lse"``): calls may ask for the
    attention state too, ``out, lse = attention(..., return_lse=True)``, lse float32
    ``[tokens, num_q_heads]`` (docs/guides/lse-cascade.md).
    """

    kind: Kind
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    page_size: int = 1
    device: str = "cpu"
    tree_verify: bool = False
    mha_head_dim: int | None = None
    mha_v_head_dim: int | None = None
    sm_scale: float | None = None
    window_left: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    causal: bool = True
    attention_chunk_size: int | None = None
    return_lse: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSpecError("kind", self.kind, "choose 'mha' or 'mla'")
        for field in ("num_q_heads", "num_kv_heads", "head_dim", "page_size"):
            _positive(field, getattr(self, field))
        if self.v_head_dim is None:
            if self.kind == "mla":
                raise InvalidSpecError(
                    "v_head_dim",
                    None,
                    "an MLA config needs v_head_dim (the latent width, e.g. 512)",
                )
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _positive("v_head_dim", self.v_head_dim)
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidSpecError(
                "num_q_heads",
                self.num_q_heads,
                f"must be a multiple of num_kv_heads={self.num_kv_heads!r} (grouped-query)",
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype, field="dtype"))
        if self.dtype in FP8_DTYPES:
            raise InvalidSpecError(
                "dtype",
                self.dtype,
                "FP8 is a KV cache format, not a compute dtype: use dtype='bfloat16' (or "
                f"'float16'/'float32') with kv_dtype={self.dtype!r}",
            )
        kv = self.dtype if self.kv_dtype is None else dtype_name(self.kv_dtype, field="kv_dtype")
        object.__setattr__(self, "kv_dtype", kv)
        self._check_variants()
        object.__setattr__(self, "device", str(self.device).strip().lower())
        if not self.device:
            raise InvalidSpecError("device", self.device, "name a device such as 'cpu' or 'cuda:0'")
        if not isinstance(self.tree_verify, bool):
            raise InvalidSpecError("tree_verify", self.tree_verify, "must be a bool")
        if self.kind == "mla":
            if self.num_kv_heads != 1:
                raise InvalidSpecError(
                    "num_kv_heads", self.num_kv_heads, "MLA has one latent KV head; use 1"
                )
            assert self.v_head_dim is not None
            if self.v_head_dim >= self.head_dim:
                raise InvalidSpecError(
                    "v_head_dim",
                    self.v_head_dim,
                    f"MLA needs v_head_dim (latent) < head_dim={self.head_dim!r} (latent + rope)",
                )
        if self.sm_scale is not None:
            problem = positive_f32_problem(self.sm_scale)
            if problem is not None:
                raise InvalidSpecError(
                    "sm_scale", self.sm_scale, f"{problem} (e.g. head_dim ** -0.5), or None"
                )
            object.__setattr__(self, "sm_scale", float(self.sm_scale))
        if (self.mha_head_dim is None) != (self.mha_v_head_dim is None):
            raise InvalidSpecError(
                "mha_head_dim",
                (self.mha_head_dim, self.mha_v_head_dim),
                "give both mha_head_dim and mha_v_head_dim (the decompressed form), or neither",
            )
        if self.mha_head_dim is not None:
            if self.kind != "mla":
                raise InvalidSpecError(
                    "mha_head_dim", self.mha_head_dim, "only an MLA config has a decompressed form"
                )
            _positive("mha_head_dim", self.mha_head_dim)
            _positive("mha_v_head_dim", self.mha_v_head_dim)

    def _check_variants(self) -> None:
        w = self.window_left
        _optional_int(
            "window_left",
            w,
            0,
            "keys p - window_left ..= p are visible (HF's sliding_window W is window_left "
            "W - 1), or None for full attention",
        )
        cap = self.logit_cap
        if cap is not None:
            # 0 (int or float) is the documented "off"; anything else is a float32 cap.
            off = not isinstance(cap, bool) and isinstance(cap, (int, float)) and cap == 0
            problem = None if off else positive_f32_problem(cap)
            if problem is not None:
                raise InvalidSpecError(
                    "logit_cap", cap, f"{problem} (e.g. 50.0), or None/0.0 for off"
                )
            object.__setattr__(self, "logit_cap", None if off else float(cap))
        if not isinstance(self.sinks, bool):
            raise InvalidSpecError("sinks", self.sinks, "must be a bool")
        for flag in ("causal", "return_lse"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidSpecError(flag, getattr(self, flag), "must be a bool")
        c = self.attention_chunk_size
        _optional_int(
            "attention_chunk_size",
            c,
            1,
            "a query at p sees keys (p // C) * C ..= p; None for no chunks",
        )
        if not self.causal and (c is not None or w is not None):
            raise InvalidSpecError(
                "causal",
                self.causal,
                "a non-causal layer attends to every key of its request: it takes no "
                "window_left or attention_chunk_size",
            )

    @property
    def variants(self) -> frozenset[str]:
        """The layer variants this config uses: a subset of ``VARIANTS``."""
        used = set()
        if self.window_left is not None:
            used.add("window")
        if self.logit_cap is not None:
            used.add("logit_cap")
        if self.sinks:
            used.add("sinks")
        if not self.causal:
            used.add("non_causal")
        if self.attention_chunk_size is not None:
            used.add("chunked")
        if self.return_lse:
            used.add("lse")
        return frozenset(used)

    @property
    def kv_fp8(self) -> bool:
        """True when the cache is FP8 (``attention`` then takes ``k_scale``/``v_scale``)."""
        return self.kv_dtype in FP8_DTYPES

    @property
    def device_type(self) -> str:
        """``"cuda"`` for ``"cuda:1"``."""
        return device_type(self.device)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def has_decompressed_form(self) -> bool:
        return self.mha_head_dim is not None

    @property
    def out_head_dim(self) -> int:
        assert self.v_head_dim is not None
        return self.v_head_dim

    def decompressed(self) -> AttnConfig:
        """The MHA config of the decompressed form (ragged K/V: one token per page).

        Only for an MLA config with ``mha_head_dim``/``mha_v_head_dim``. The layer variants
        (window, cap, sinks) and ``return_lse`` carry over: the decompressed form computes the
        same attention.
        ``kv_dtype`` becomes ``dtype``: its K/V are the model's own decompressed tensors, not
        the cache (and an FP8 MLA config is served in the absorbed form only).
        """
        if self.mha_head_dim is None or self.mha_v_head_dim is None:
            raise InvalidSpecError(
                "mha_head_dim", None, "this config names no decompressed form (kind 'mla' only)"
            )
        return AttnConfig(
            kind="mha",
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_q_heads,
            head_dim=self.mha_head_dim,
            v_head_dim=self.mha_v_head_dim,
            dtype=self.dtype,
            kv_dtype=self.dtype,
            page_size=1,
            device=self.device,
            tree_verify=self.tree_verify,
            sm_scale=self.sm_scale,
            window_left=self.window_left,
            logit_cap=self.logit_cap,
            sinks=self.sinks,
            causal=self.causal,
            attention_chunk_size=self.attention_chunk_size,
            return_lse=self.return_lse,
        )

    def replace(self, **changes: Any) -> AttnConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(field: str, value: object) -> None:
    problem = int_problem(value, low=1)
    if problem is not None:
        raise InvalidSpecError(field, value, problem)


def _optional_int(field: str, value: object, low: int, meaning: str) -> None:
    """None, or an int >= ``low``; else ``InvalidSpecError`` saying what the field means."""
    if value is not None:
        problem = int_problem(value, low=low)
        if problem is not None:
            raise InvalidSpecError(field, value, f"{problem}: {meaning}")
