"""``TensorChecks``: the per-call checks of ``q``/``k_cache``/``v_cache`` for one backend.

Attribute reads only: shapes, dtypes, devices, layout, and the largest page index of the
planned snapshot against the cache given at this call (an FP8 config's cache must have the FP8
dtype itself); ``check_sinks(sinks, q)`` for configs with sinks. The decompressed, chunked-prefix
MLA form (``AttnForm.MHA_CHUNKED``) has its call checked here too, once for every backend
serving it: ``check_chunked`` (the arguments and the new tokens' rows) and ``prefix_chunks``
(each prefix chunk, and that the chunks cover each request's prefix exactly).

>>> import torch
>>> from attn_dispatch import AttnBatch, AttnConfig, Phase
>>> from attn_dispatch.backend import BatchSnapshot
>>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
>>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9],
...                         page_tables=[[3], [0, 1]], page_size=8)
>>> snap = BatchSnapshot.of(batch, config.page_size)
>>> q, k_cache = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
>>> checks = TensorChecks.of(config, backend="mine", layout="rows")   # once per backend object
>>> checks.check(snap, q, k_cache, k_cache)       # every layer; returns the cache's page count
4
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

import torch

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._snapshot import BatchSnapshot
from attn_dispatch._snapshot import StepStats
from attn_dispatch._values import check_out
from attn_dispatch._values import check_scale
from attn_dispatch._values import check_sinks

if TYPE_CHECKING:
    from attn_dispatch._batch import AttnBatch

__all__ = ["Layout", "TensorChecks"]

Layout = Literal["any", "rows", "contiguous", "q_rows"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorChecks:
    """Per-call checks of ``q``/``k_cache``/``v_cache`` for one backend object.

    ``layout``: "any" (the kernel gathers with torch ops), "rows" (last dim stride 1),
    "contiguous" (whole tensors), or "q_rows" (contiguous caches; q's heads dense, each token's
    ``[heads, head_dim]`` one block, its rows at any stride: a column slice of a fused QKV
    projection). Costs attribute reads only; no device work.
    """

    backend: str
    mla: bool
    q_tail: tuple[int, int]
    k_tail: tuple[int, ...]
    v_tail: tuple[int, ...] | None
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device_type: str
    layout: Layout
    # The output's (and V's) head dim: out's last dim (the latent width for MLA), the chunked
    # form's v_new and chunks. 0: not given (a hand-built TensorChecks), read from the tails.
    out_dim: int = 0
    sinks: bool = False  # the config has sinks: a call passes them; without, it passes none

    @classmethod
    def of(
        cls,
        config: Any,
        *,
        backend: str,
        layout: Layout = "any",
        q_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        device_type: str | None = None,
    ) -> TensorChecks:
        c = config
        mla = c.kind == "mla"
        dv = c.v_head_dim if c.v_head_dim is not None else c.head_dim
        return cls(
            backend=backend,
            mla=mla,
            q_tail=(c.num_q_heads, c.head_dim),
            k_tail=(c.page_size, c.head_dim) if mla else (c.page_size, c.num_kv_heads, c.head_dim),
            v_tail=None if mla else (c.page_size, c.num_kv_heads, dv),
            q_dtype=q_dtype if q_dtype is not None else getattr(torch, c.dtype),
            kv_dtype=kv_dtype if kv_dtype is not None else getattr(torch, str(c.kv_dtype)),
            device_type=device_type if device_type is not None else c.device_type,
            layout=layout,
            out_dim=int(c.out_head_dim),
            sinks=bool(c.sinks),
        )

    def check(self, snap: BatchSnapshot, q: Any, k_cache: Any, v_cache: Any) -> int:
        """Raise ``InvalidBatchError`` unless the tensors fit the config and the snapshot;
        returns the cache's page count."""
        if type(getattr(snap, "step", None)) is not StepStats:
            # A plan whose snapshot (or its counts) was replaced after it was issued.
            raise InvalidBatchError(
                "plan",
                f"{self.backend}: the plan's batch snapshot is not the one it was made with; "
                "plan the batch again",
            )
        try:
            qs = q.shape
            ks = k_cache.shape
            ok = (
                len(qs) == 3
                and qs[0] == snap.num_tokens
                and qs[1:] == self.q_tail
                and q.dtype == self.q_dtype
                and ks[1:] == self.k_tail
                and k_cache.dtype == self.kv_dtype
                and q.device.type == self.device_type
                and k_cache.device == q.device
            )
            pages = ks[0] if len(ks) else 0
            if ok and self.v_tail is not None:
                vs = v_cache.shape
                ok = (
                    vs[0] == pages
                    and vs[1:] == self.v_tail
                    and v_cache.dtype == self.kv_dtype
                    and v_cache.device == q.device
                )
            elif ok:
                ok = v_cache is None
        except AttributeError:
            ok = False
        if not ok or (snap.max_page is not None and snap.max_page >= pages):
            self._explain(snap, q, k_cache, v_cache)
        if self.layout != "any" and not self._layout_ok(q, k_cache, v_cache):
            self._explain_layout(q, k_cache, v_cache)
        return int(pages)

    def check_sinks(self, sinks: Any, q: torch.Tensor) -> None:
        """Raise ``InvalidBatchError("sinks", ...)`` unless ``sinks`` is a contiguous float32
        ``[num_q_heads]`` tensor on ``q``'s device: the core's one rule
        (``attn_dispatch._values.check_sinks``), for a handler called without a binding."""
        check_sinks(sinks, q, self.q_tail[0], self.backend)

    @staticmethod
    def check_scales(
        sm_scale: Any, k_scale: Any, v_scale: Any, *, fp8: bool
    ) -> tuple[float, float, float]:
        """The per-call scales of a handler called without a binding, as floats
        ``(sm_scale, k_scale, v_scale)``: each a finite positive number
        (``attn_dispatch._values.check_scale``), and ``k_scale``/``v_scale`` 1.0 unless the
        cache is FP8. ``InvalidBatchError`` names the scale."""
        ks, vs = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        if not fp8 and (ks, vs) != (1.0, 1.0):
            raise InvalidBatchError("k_scale", "scales apply to FP8 caches only")
        return check_scale("sm_scale", sm_scale), ks, vs

    def check_keywords(self, q: Any, *, sinks: Any = None, return_lse: Any = False) -> None:
        """The per-call keywords of a handler called without a binding (a binding's calls
        passed the core's same rules): ``sinks`` given exactly when the config has them, and
        then a float32 ``[num_q_heads]`` tensor on ``q``'s device; ``return_lse`` a Python
        bool. ``InvalidBatchError`` names the keyword."""
        if return_lse is not True and return_lse is not False:
            raise InvalidBatchError(
                "return_lse", f"{self.backend}: must be True or False, got {return_lse!r}"
            )
        if self.sinks:
            if sinks is None:
                raise InvalidBatchError(
                    "sinks", f"{self.backend}: the config has sinks=True; pass sinks= per call"
                )
            self.check_sinks(sinks, q)
        elif sinks is not None:
            raise InvalidBatchError(
                "sinks", f"{self.backend}: given to a layer whose config has sinks=False"
            )

    def check_chunked(
        self,
        q: Any,
        k_new: Any,
        v_new: Any,
        batch: AttnBatch,
        sm_scale: Any,
        prefix: Any,
        *,
        sinks: Any = None,
        return_lse: Any = False,
    ) -> tuple[BatchSnapshot, float]:
        """The checks of an ``AttnForm.MHA_CHUNKED`` call ``run(q, k_new, v_new, batch,
        sm_scale, prefix, sinks=..., return_lse=...)``, before anything is read: the keywords
        (``check_keywords``), ``prefix`` given, the batch causal (no custom mask), the scale,
        then the batch copied and checked (it is this form's plan; no page is read, so page
        coverage is not checked) and ``q``/``k_new``/``v_new`` as the new tokens' rows
        ``[tokens, num_q_heads, head_dim]`` (``v_new``: the output's head dim) in the config's
        dtype on one device of the bound type. Returns ``(snapshot, scale)``; then iterate the
        chunks through ``prefix_chunks``.
        """
        self.check_keywords(q, sinks=sinks, return_lse=return_lse)
        if prefix is None:
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: the 'mha_chunked' form needs the cached prefix as chunks: "
                "attention(q, k_new, v_new, sm_scale=..., prefix=latent_prefix_chunks(...))",
            )
        if getattr(batch, "custom_mask", None) is not None:
            raise InvalidBatchError(
                "custom_mask", f"{self.backend}: the 'mha_chunked' form is causal only"
            )
        scale = check_scale("sm_scale", sm_scale)
        snap = BatchSnapshot.of(batch, None)
        t, heads, d = snap.num_tokens, self.q_tail[0], self.q_tail[1]
        for name, x, width in (("q", q, d), ("k_new", k_new, d), ("v_new", v_new, self.out_dim)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (t, heads, width):
                raise InvalidBatchError(
                    name,
                    f"{self.backend}: shape {tuple(getattr(x, 'shape', ()))} != "
                    f"[{t}, {heads}, {width}] (the new tokens' rows)",
                )
            if x.dtype != self.q_dtype or x.device.type != self.device_type or x.device != q.device:
                raise InvalidBatchError(
                    name,
                    f"{self.backend}: dtype {x.dtype} on {x.device}, want {self.q_dtype} on "
                    f"{q.device if name != 'q' else self.device_type!r}",
                )
        return snap, scale

    def prefix_chunks(
        self, prefix: Any, snap: BatchSnapshot, q: Any
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """The chunks of a checked chunked call's ``prefix`` (``check_chunked``), each checked
        before it is yielded: ``(k_chunk [rows, heads, head_dim], v_chunk [rows, heads,
        out dim], indptr)`` in the config's dtype on ``q``'s device, ``indptr`` (yielded as
        ints) non-decreasing within the chunk's rows with one entry per request and one more.
        A chunk reaching past a request's prefix (``kv_len - q_len`` tokens) is refused before
        it is yielded, and chunks that end short of one are refused after the last: a handler
        never answers from fewer or other keys. ``InvalidBatchError`` field ``prefix`` (with
        ``request`` where one request is at fault)."""
        try:
            chunks = iter(prefix)
        except TypeError:
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: must be an iterable of (k_chunk, v_chunk, indptr), got "
                f"{type(prefix).__name__}",
            ) from None
        b = snap.num_requests
        qo = snap.qo_indptr_host.tolist()
        lens = snap.kv_lens_host.tolist()
        want = [lens[i] - (qo[i + 1] - qo[i]) for i in range(b)]
        seen = [0] * b
        for chunk in chunks:
            try:
                k_chunk, v_chunk, indptr = chunk
            except (TypeError, ValueError):
                raise InvalidBatchError(
                    "prefix",
                    f"{self.backend}: each chunk must be (k_chunk, v_chunk, indptr), got "
                    f"{type(chunk).__name__}",
                ) from None
            ind = self._chunk_indptr(k_chunk, v_chunk, indptr, b, q.device)
            for i in range(b):
                seen[i] += ind[i + 1] - ind[i]
                if seen[i] > want[i]:
                    raise InvalidBatchError(
                        "prefix",
                        f"{self.backend}: chunks cover more than the {want[i]} prefix tokens "
                        f"the request has ({seen[i]} so far)",
                        request=i,
                    )
            yield k_chunk, v_chunk, ind
        bad = next((i for i in range(b) if seen[i] != want[i]), None)
        if bad is not None:
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: chunks cover {seen[bad]} prefix tokens but the request has "
                f"{want[bad]}",
                request=bad,
            )

    def _chunk_indptr(
        self, k_chunk: Any, v_chunk: Any, indptr: Any, num_requests: int, device: Any
    ) -> list[int]:
        heads, widths = self.q_tail[0], (self.q_tail[1], self.out_dim)
        for name, x, width in (("k_chunk", k_chunk, widths[0]), ("v_chunk", v_chunk, widths[1])):
            if not isinstance(x, torch.Tensor):
                raise InvalidBatchError(
                    "prefix", f"{self.backend}: {name} must be a torch.Tensor, got {type(x)!r}"
                )
            if x.dim() != 3 or tuple(x.shape[1:]) != (heads, width):
                raise InvalidBatchError(
                    "prefix",
                    f"{self.backend}: {name} shape {tuple(x.shape)} != [rows, {heads}, {width}]",
                )
            if x.dtype != self.q_dtype or x.device != device:
                raise InvalidBatchError(
                    "prefix",
                    f"{self.backend}: {name} is {x.dtype} on {x.device}, want {self.q_dtype} "
                    f"on {device}",
                )
        rows = int(k_chunk.shape[0])
        if v_chunk.shape[0] != rows:
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: k_chunk has {rows} rows, v_chunk {int(v_chunk.shape[0])}",
            )
        try:
            ind = [int(x) for x in indptr]
        except (TypeError, ValueError):
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: chunk indptr must be a sequence of ints, got {indptr!r}",
            ) from None
        if len(ind) != num_requests + 1:
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: chunk indptr has {len(ind)} entries, want {num_requests + 1}",
            )
        if ind and (ind[0] < 0 or ind[-1] > rows or any(a > b for a, b in itertools.pairwise(ind))):
            raise InvalidBatchError(
                "prefix",
                f"{self.backend}: chunk indptr {ind!r} must be non-decreasing within the "
                f"chunk's {rows} rows",
            )
        return ind

    def check_out(self, out: Any, q: Any, k_cache: Any, v_cache: Any) -> None:
        """Raise ``InvalidBatchError("out", ...)`` unless ``out`` can receive this call's
        output: a contiguous ``[q rows, num_q_heads, v_head_dim]`` tensor of q's dtype on q's
        device that shares no memory with q or the caches. The core's one rule
        (``attn_dispatch._values.check_out``), for a handler called without a binding."""
        dv = self.out_dim
        if not dv:
            dv = self.v_tail[-1] if self.v_tail is not None else self.q_tail[1]
        check_out(out, q, k_cache, v_cache, self.q_tail[0], dv, self.backend)

    def _layout_ok(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> bool:
        if self.layout == "contiguous":
            return q.is_contiguous() and k.is_contiguous() and (v is None or v.is_contiguous())
        if self.layout == "q_rows":
            return _heads_dense(q) and k.is_contiguous() and (v is None or v.is_contiguous())
        return q.stride(-1) == 1 and k.stride(-1) == 1 and (v is None or v.stride(-1) == 1)

    def _explain_layout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
            if t is None:
                continue
            if self.layout == "q_rows":
                if name == "q" and not _heads_dense(t):
                    raise InvalidBatchError(
                        name,
                        f"{self.backend}: needs each token's [heads, head_dim] dense (strides "
                        f"({t.shape[-1]}, 1) in its last two dims, got {tuple(t.stride())[1:]}); "
                        "its rows may be strided (call .contiguous())",
                    )
                if name != "q" and not t.is_contiguous():
                    raise InvalidBatchError(
                        name, f"{self.backend}: must be contiguous (call .contiguous())"
                    )
                continue
            if not self._layout_ok(t, t, None):
                need = (
                    "must be contiguous (call .contiguous())"
                    if self.layout == "contiguous"
                    else f"needs contiguous rows (last-dim stride 1, got {t.stride(-1)})"
                )
                raise InvalidBatchError(name, f"{self.backend}: {need}")

    def _explain(self, snap: BatchSnapshot, q: Any, k: Any, v: Any) -> None:
        b = self.backend
        for name, t in (("q", q), ("k_cache", k)):
            if not isinstance(t, torch.Tensor):
                raise InvalidBatchError(name, f"{b}: expected a torch.Tensor, got {type(t)!r}")
        if q.dim() != 3 or tuple(q.shape[1:]) != self.q_tail:
            raise InvalidBatchError(
                "q",
                f"{b}: shape {tuple(q.shape)} != [tokens, num_q_heads={self.q_tail[0]}, "
                f"head_dim={self.q_tail[1]}] of the bound config",
            )
        if q.shape[0] != snap.num_tokens:
            raise InvalidBatchError(
                "q",
                f"{b}: {q.shape[0]} rows but the batch has {snap.num_tokens} query tokens; "
                "pass one q row per query token of the planned batch",
            )
        if q.dtype != self.q_dtype:
            raise InvalidBatchError("q", f"{b}: dtype {q.dtype} != bound config's {self.q_dtype}")
        if q.device.type != self.device_type:
            raise InvalidBatchError(
                "q", f"{b}: on {q.device}, the backend was bound for {self.device_type!r}"
            )
        if tuple(k.shape[1:]) != self.k_tail or k.dim() != len(self.k_tail) + 1:
            want = ", ".join(map(str, self.k_tail))
            raise InvalidBatchError(
                "k_cache", f"{b}: shape {tuple(k.shape)} != [pages, {want}] of the bound config"
            )
        if k.dtype != self.kv_dtype:
            raise InvalidBatchError(
                "k_cache", f"{b}: dtype {k.dtype} != bound config's kv dtype {self.kv_dtype}"
            )
        if k.device != q.device:
            raise InvalidBatchError("k_cache", f"{b}: on {k.device}, q on {q.device}")
        pages = k.shape[0]
        if self.v_tail is None:
            if v is not None:
                raise InvalidBatchError(
                    "v_cache",
                    f"{b}: must be None for MLA (V is the first v_head_dim columns of k_cache)",
                )
        else:
            if not isinstance(v, torch.Tensor):
                raise InvalidBatchError(
                    "v_cache", f"{b}: an MHA layer needs a v_cache tensor, got {type(v)!r}"
                )
            want_v = (pages, *self.v_tail)
            if tuple(v.shape) != want_v:
                raise InvalidBatchError(
                    "v_cache",
                    f"{b}: shape {tuple(v.shape)} != {list(want_v)} (as many pages as k_cache)",
                )
            if v.dtype != self.kv_dtype:
                raise InvalidBatchError(
                    "v_cache", f"{b}: dtype {v.dtype} != bound config's kv dtype {self.kv_dtype}"
                )
            if v.device != q.device:
                raise InvalidBatchError("v_cache", f"{b}: on {v.device}, q on {q.device}")
        if snap.max_page is not None and snap.max_page >= pages:
            raise InvalidBatchError(
                "kv_indices",
                f"{b}: page index {snap.max_page} is out of range for a cache of {pages} pages; "
                "every page index must name a page of the k_cache/v_cache given to this call",
            )
        raise AssertionError("TensorChecks flagged tensors that break no rule")  # pragma: no cover


# Public through attn_dispatch.backend (loaded lazily there): reprs and pickles name it.
TensorChecks.__module__ = "attn_dispatch.backend"


def _heads_dense(q: torch.Tensor) -> bool:
    """``q [tokens, heads, dim]``'s last two dims dense (a dim of size 1, or no tokens: any
    stride), whatever its row stride."""
    tokens, heads, dim = q.shape
    if tokens == 0:
        return True
    _, s1, s2 = q.stride()
    return (dim == 1 or s2 == 1) and (heads == 1 or s1 == dim) and q.stride(0) >= 0
