"""The batch contract, written once: every backend and ``AttnBatch`` itself call this module.

Three layers, from the most to the least expensive:

- ``check_metadata`` / ``check_indices`` / ``mask_offsets``: the rules of the paged-KV
  contract on host int32 tensors (``AttnBatch`` runs them on construction).
- ``BatchSnapshot.of(batch, page_size)``: at plan time, private contiguous copies of the index
  tensors a kernel will read, re-checked with the rules above at the *bound* page size. A plan
  holds the snapshot, so editing the batch's tensors after planning never reaches a kernel,
  and a batch built without ``page_size`` is still checked against the pages it names.
- ``TensorChecks.check(snap, q, k_cache, v_cache)``: per call, attribute reads only: shapes,
  dtypes, devices, layout, and the largest page index against the cache given at this call
  (an FP8 config's cache must have the FP8 dtype itself); ``check_sinks(sinks, q)`` for
  configs with sinks.

>>> snap = BatchSnapshot.of(batch, config.page_size)          # once per forward
>>> checks = TensorChecks.of(config, layout="rows")           # once per backend object
>>> checks.check(snap, q, k_cache, v_cache)                   # every layer

On a CUDA batch the snapshot copies the index tensors on the device (no host sync) and checks
the host copies only; page index values stay unknown (``max_page is None``) unless the
backend asks for ``check_device=True`` (its ``validate`` option), so GPU kernels must mask
out-of-range pages themselves.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any
from typing import Literal

import torch

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch._values import check_sinks

__all__ = [
    "BatchSnapshot",
    "StepStats",
    "TensorChecks",
    "check_indices",
    "check_metadata",
    "mask_offsets",
    "per_request_mask",
    "refill",
    "window_flat_mask",
    "window_tree_mask",
]

_I32 = torch.int32


def check_metadata(
    phase: Phase,
    qo: torch.Tensor,
    kv: torch.Tensor,
    lens: torch.Tensor,
    num_indices: int,
    page_size: int | None,
) -> tuple[int, int, int]:
    """Check host int32 ``qo_indptr``/``kv_indptr``/``kv_lens`` of one batch.

    Returns ``(num_tokens, max_q_len, max_kv_len)``. ``num_indices`` is ``len(kv_indices)``;
    ``page_size`` (when given) checks that every request names pages for all its tokens.
    A valid batch costs one pass over Python ints (or a few vector ops for large batches);
    the message naming the first broken rule is computed only when one breaks.
    """
    b = lens.numel()
    if qo.numel() != b + 1:
        raise InvalidBatchError("qo_indptr", f"length {qo.numel()} != len(kv_lens) + 1 = {b + 1}")
    if kv.numel() != b + 1:
        raise InvalidBatchError("kv_indptr", f"length {kv.numel()} != len(kv_lens) + 1 = {b + 1}")
    if page_size is not None and page_size <= 0:
        raise InvalidBatchError("page_size", f"must be positive, got {page_size!r}")
    # Small batches (the decode hot case) check fastest as Python ints; an elementwise torch
    # op costs ~3 us on tiny tensors, a list pass ~0.05 us per request.
    if b <= _LIST_MAX:
        verdict = _verdict_lists(phase, qo.tolist(), kv.tolist(), lens.tolist(), page_size)
    else:
        verdict = _verdict_tensors(phase, qo, kv, lens, page_size)
    if verdict is not None and verdict[3] == num_indices:
        return verdict[0], verdict[1], verdict[2]
    # The slow path: name the first broken rule (field and request).
    for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv)):
        if int(ptr[0]) != 0:
            raise InvalidBatchError(name, f"must start at 0, starts at {int(ptr[0])}")
        bad = _first(ptr[1:] < ptr[:-1])
        if bad is not None:
            raise InvalidBatchError(name, "must be non-decreasing", request=bad)
    if int(kv[-1]) != num_indices:
        raise InvalidBatchError(
            "kv_indptr", f"last value {int(kv[-1])} != len(kv_indices) = {num_indices}"
        )
    q_lens = qo[1:] - qo[:-1]
    bad = _first(lens < q_lens)
    if bad is not None:
        raise InvalidBatchError(
            "kv_lens",
            f"kv_len {int(lens[bad])} < q_len {int(q_lens[bad])}: the cache must hold the "
            "new tokens too",
            request=bad,
        )
    bad = _first(q_lens < 1)
    if bad is not None:
        raise InvalidBatchError("qo_indptr", "every request needs >= 1 query token", request=bad)
    if phase is Phase.DECODE:
        bad = _first(q_lens != 1)
        if bad is not None:
            raise InvalidBatchError(
                "qo_indptr",
                f"DECODE needs exactly one query per request, got {int(q_lens[bad])}",
                request=bad,
            )
    if page_size is not None:
        need = (lens.long() + page_size - 1) // page_size
        bad = _first((kv[1:] - kv[:-1]) < need)
        if bad is not None:
            raise InvalidBatchError(
                "kv_indptr",
                f"{int(kv[bad + 1] - kv[bad])} pages cannot hold kv_len {int(lens[bad])} "
                f"at page_size {page_size}",
                request=bad,
            )
    raise AssertionError("check_metadata flagged a batch that breaks no rule")  # pragma: no cover


_LIST_MAX = 128
_LIST_MAX_INDICES = 256
_sub = operator.sub
_lt = operator.lt
_gt = operator.gt


def _verdict_lists(
    phase: Phase, qo: list[int], kv: list[int], lens: list[int], page_size: int | None
) -> tuple[int, int, int, int] | None:
    """``(num_tokens, max_q_len, max_kv_len, kv_indptr[-1])``, or None when a rule breaks."""
    if qo[0] or kv[0]:
        return None
    if not lens:
        return 0, 0, 0, kv[-1]
    # map() over builtins: about twice as fast as the same comprehension.
    q_lens = list(map(_sub, qo[1:], qo))
    pages = list(map(_sub, kv[1:], kv))
    if min(q_lens) < 1 or min(pages) < 0 or any(map(_lt, lens, q_lens)):
        return None
    max_q = max(q_lens)
    if phase is Phase.DECODE and max_q != 1:
        return None
    if page_size is not None and any(map(_gt, lens, [p * page_size for p in pages])):
        return None
    return qo[-1], max_q, max(lens), kv[-1]


def _verdict_tensors(
    phase: Phase, qo: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, page_size: int | None
) -> tuple[int, int, int, int] | None:
    """``_verdict_lists`` as a few vector ops, for large batches."""
    q_lens = qo.diff()
    pages = kv.diff()
    bad = (q_lens < 1) | (pages < 0) | (lens < q_lens)
    if page_size is not None:
        # lens > pages * page_size, without int32 overflow for huge page counts
        bad |= (lens - 1).div(page_size, rounding_mode="floor") >= pages
    if phase is Phase.DECODE:
        bad |= q_lens != 1
    ends = torch.stack((qo[0], kv[0], bad.any().int(), qo[-1], q_lens.max(), lens.max(), kv[-1]))
    qo0, kv0, any_bad, total, max_q, max_kv, kv_last = ends.tolist()
    if qo0 or kv0 or any_bad:
        return None
    return total, max_q, max_kv, kv_last


def check_indices(kv: torch.Tensor, indices: torch.Tensor, num_pages: int | None) -> int:
    """The largest page index of a host ``kv_indices`` (-1 when empty); raises for a
    negative index or one ``>= num_pages``."""
    if indices.numel() == 0:
        return -1
    lo_t, hi_t = torch.aminmax(indices)
    lo, hi = lo_t.item(), hi_t.item()
    if lo < 0 or (num_pages is not None and hi >= num_pages):
        limit = num_pages if num_pages is not None else hi + 1
        where = int(((indices < 0) | (indices >= limit)).int().argmax())
        req = int(torch.searchsorted(kv[1:], torch.tensor(where, dtype=kv.dtype), right=True))
        what = (
            f"page index out of range [0, {num_pages}) (min {lo}, max {hi})"
            if num_pages is not None
            else f"page index {lo} is negative"
        )
        raise InvalidBatchError(
            "kv_indices", f"{what}; a page index names a page of the KV cache", request=req
        )
    return int(hi)


def mask_offsets(
    mask: Any, qo: torch.Tensor, lens: torch.Tensor, *, rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a flat bool ``custom_mask`` against the host lengths.

    Returns ``(mask_indptr int64 [B+1], q_lens)``; ``rows=True`` also checks that every
    query row may attend to some key (a Python loop: construction time only).
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise InvalidBatchError("custom_mask", "must be a flat 1-D torch.bool tensor")
    q_lens = qo.diff().long()
    sizes = q_lens * lens.long()
    offsets = torch.zeros(sizes.numel() + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    total = int(offsets[-1])
    if total != mask.numel():
        raise InvalidBatchError(
            "custom_mask", f"length {mask.numel()} != sum(q_len * kv_len) = {total}"
        )
    if rows:
        host = mask.cpu()
        ql, kl, offs = q_lens.tolist(), lens.tolist(), offsets.tolist()
        for i in range(sizes.numel()):
            block = host[offs[i] : offs[i + 1]].view(ql[i], kl[i])
            row = _first(~block.any(dim=1))
            if row is not None:
                raise InvalidBatchError(
                    "custom_mask",
                    f"query {row} may attend to no key (every row needs at least itself)",
                    request=i,
                )
    return offsets, q_lens


def _first(flags: torch.Tensor) -> int | None:
    """Index of the first True, or None."""
    if flags.numel() == 0 or not bool(flags.any()):
        return None
    return int(flags.int().argmax())


def _index_tensor(batch: Any, name: str) -> torch.Tensor:
    t = getattr(batch, name, None)
    if not isinstance(t, torch.Tensor) or t.dtype != _I32 or t.dim() != 1:
        what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} {t.dim()}-D"
        raise InvalidBatchError(name, f"must be a 1-D torch.int32 tensor, got {what}")
    return t


class StepStats:
    """The counts of one step that a CUDA-graph-captured plan follows from replay to replay
    (``refill``): the only part of a snapshot that ever changes, kept apart from the frozen
    value so that nothing mutates a frozen object."""

    __slots__ = ("max_kv_len", "max_page", "max_q_len", "num_tokens")

    def __init__(self, num_tokens: int, max_q_len: int, max_kv_len: int, max_page: int | None):
        self.num_tokens = num_tokens
        self.max_q_len = max_q_len
        self.max_kv_len = max_kv_len
        self.max_page = max_page

    def follow(self, other: StepStats) -> None:
        """Take ``other``'s counts (a captured plan replaying a new step)."""
        self.num_tokens = other.num_tokens
        self.max_q_len = other.max_q_len
        self.max_kv_len = other.max_kv_len
        self.max_page = other.max_page


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class BatchSnapshot:
    """What a plan keeps of a batch: checked counts and private copies of its index tensors.

    Device tensors (``qo_indptr`` .. ``mask_indptr``) are contiguous copies on the batch's
    device, the ones kernels read; ``*_host`` are CPU int32 copies for planning (the same
    tensors on a CPU batch). ``page_size`` is the bound config's. ``max_page`` is the largest
    page index of ``kv_indices`` (-1 when there is none), or None when it was not read (a
    device batch planned without ``check_device``). ``num_tokens``, ``max_q_len``,
    ``max_kv_len`` and ``max_page`` are read from ``step`` (see ``StepStats``).
    """

    phase: Phase
    page_size: int | None
    num_requests: int
    step: StepStats
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_lens_host: torch.Tensor

    @classmethod
    def of(cls, batch: Any, page_size: int | None, *, check_device: bool = False) -> BatchSnapshot:
        """Copy and check ``batch`` for a backend bound with ``page_size``.

        ``page_size=None`` is for a caller that reads no pages (the chunked-prefix form):
        then page coverage is not checked.

        ``check_device`` (a CUDA batch only) reads the device index tensors back to the host
        to check them too: a device sync, for ``validate`` options and debugging.
        """
        phase = getattr(batch, "phase", None)
        if not isinstance(phase, Phase):
            raise InvalidBatchError(
                "batch",
                f"expected an AttnBatch (a Phase in .phase), got {type(batch).__name__} with "
                f"phase {phase!r}",
            )
        given = getattr(batch, "page_size", None)
        if given is not None and page_size is not None and given != page_size:
            raise InvalidBatchError(
                "page_size",
                f"batch page_size {given!r} != bound config page_size {page_size!r}; build the "
                "batch for the page size of the runner it is planned for",
            )
        qo_d = _index_tensor(batch, "qo_indptr")
        kv_d = _index_tensor(batch, "kv_indptr")
        idx_d = _index_tensor(batch, "kv_indices")
        lens_d = _index_tensor(batch, "kv_lens")
        dev = idx_d.device
        on_cpu = idx_d.is_cpu
        b = lens_d.numel()
        n_idx = idx_d.numel()
        n_meta = 3 * b + 2
        buf = None
        if qo_d.numel() == b + 1 and kv_d.numel() == b + 1:
            # One copy holds all four (a cat is one op; four clones cost three more), and the
            # views into it are contiguous.
            try:
                buf = torch.cat((qo_d, kv_d, lens_d, idx_d))
            except RuntimeError as exc:  # index tensors on different devices
                raise InvalidBatchError(
                    "kv_indices", f"the index tensors must share one device: {exc}"
                ) from None
            qo, kv, lens, idx = buf.split_with_sizes((b + 1, b + 1, b, n_idx))
        else:  # lengths that disagree: check_metadata names the field
            fmt = torch.contiguous_format
            qo, kv, lens, idx = (t.clone(memory_format=fmt) for t in (qo_d, kv_d, lens_d, idx_d))
        if on_cpu:
            qo_h, kv_h, lens_h = qo, kv, lens
        else:
            qo_h, kv_h, lens_h = (
                _index_tensor(batch, name).clone(memory_format=torch.contiguous_format)
                for name in ("qo_indptr_host", "kv_indptr_host", "kv_lens_host")
            )
            if check_device:
                for name, d, h in (("qo_indptr", qo, qo_h), ("kv_indptr", kv, kv_h),
                                   ("kv_lens", lens, lens_h)):  # fmt: skip
                    if not torch.equal(d.cpu(), h):
                        raise InvalidBatchError(
                            name,
                            "the device tensor differs from its host copy (edited after the "
                            "batch was built?); build a new AttnBatch for new metadata",
                        )
        max_page: int | None = None
        if on_cpu and buf is not None and b <= _LIST_MAX:
            # The common small batch: one host read serves every check (see check_metadata).
            whole = n_idx <= _LIST_MAX_INDICES
            vals = buf.tolist() if whole else buf[:n_meta].tolist()
            verdict = _verdict_lists(
                phase, vals[: b + 1], vals[b + 1 : n_meta - b], vals[n_meta - b : n_meta], page_size
            )
            if verdict is None or verdict[3] != n_idx:
                check_metadata(phase, qo_h, kv_h, lens_h, n_idx, page_size)  # raises, naming why
            assert verdict is not None
            total, max_q, max_kv = verdict[0], verdict[1], verdict[2]
            if not whole:
                max_page = check_indices(kv_h, idx, None)
            elif n_idx:
                pages = vals[n_meta:]
                max_page = max(pages)
                if min(pages) < 0:
                    check_indices(kv_h, idx, None)  # raises, naming the request
            else:
                max_page = -1
        else:
            total, max_q, max_kv = check_metadata(phase, qo_h, kv_h, lens_h, n_idx, page_size)
            if on_cpu:
                max_page = check_indices(kv_h, idx, None)
            elif check_device:
                max_page = check_indices(kv_h, idx.cpu(), None)
        mask = mask_indptr = None
        if getattr(batch, "custom_mask", None) is not None:
            offsets, _ = mask_offsets(batch.custom_mask, qo_h, lens_h, rows=False)
            mask = batch.custom_mask.to(dev).clone(memory_format=torch.contiguous_format)
            # pinned: a copy from pageable memory would wait for the device's queue
            mask_indptr = offsets if on_cpu else offsets.pin_memory().to(dev, non_blocking=True)
        return cls(
            phase=phase,
            page_size=page_size,
            num_requests=lens_h.numel(),
            step=StepStats(total, max_q, max_kv, max_page),
            qo_indptr=qo,
            kv_indptr=kv,
            kv_indices=idx,
            kv_lens=lens,
            custom_mask=mask,
            mask_indptr=mask_indptr,
            qo_indptr_host=qo_h,
            kv_indptr_host=kv_h,
            kv_lens_host=lens_h,
        )

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens

    @property
    def max_q_len(self) -> int:
        return self.step.max_q_len

    @property
    def max_kv_len(self) -> int:
        return self.step.max_kv_len

    @property
    def max_page(self) -> int | None:
        return self.step.max_page


Layout = Literal["any", "rows", "contiguous"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorChecks:
    """Per-call checks of ``q``/``k_cache``/``v_cache`` for one backend object.

    ``layout``: "any" (the kernel gathers with torch ops), "rows" (last dim stride 1), or
    "contiguous" (whole tensors). Costs attribute reads only; no device work.
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
        )

    def check(self, snap: BatchSnapshot, q: Any, k_cache: Any, v_cache: Any) -> int:
        """Raise ``InvalidBatchError`` unless the tensors fit the config and the snapshot;
        returns the cache's page count."""
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

    def _layout_ok(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> bool:
        if self.layout == "contiguous":
            return q.is_contiguous() and k.is_contiguous() and (v is None or v.is_contiguous())
        return q.stride(-1) == 1 and k.stride(-1) == 1 and (v is None or v.stride(-1) == 1)

    def _explain_layout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
            if t is not None and not self._layout_ok(t, t, None):
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


def window_tree_mask(mask: torch.Tensor, window_left: int) -> torch.Tensor:
    """Apply a sliding window to a custom (tree) mask ``[..., queries, keys]`` (bool).

    A query sees the ``window_left + 1`` most recent keys *its mask allows* (in cache order):
    for a draft node that is the prefix plus its ancestors, so tree verify sees exactly what
    decoding that path token by token would see; for a causal mask it is the positional
    window ``p - window_left ..= p``. Backends with a mask-taking kernel can fold the window
    into the mask with this once per plan.

    >>> window_tree_mask(torch.ones(1, 3, dtype=torch.bool), 1)
    tensor([[False,  True,  True]])
    """
    # Count the allowed keys at or after each key: its rank from the query's end.
    rank = mask.flip(-1).to(torch.int32).cumsum(-1).flip(-1)
    return mask & (rank <= window_left + 1)


def window_flat_mask(
    custom_mask: torch.Tensor, q_lens: list[int], kv_lens: list[int], window_left: int
) -> torch.Tensor:
    """``window_tree_mask`` on a flat batch mask (see ``per_request_mask``)."""
    return per_request_mask(
        custom_mask, q_lens, kv_lens, lambda m: window_tree_mask(m, window_left)
    )


def per_request_mask(
    custom_mask: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    fold: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``fold`` applied to each request's ``[q_len, kv_len]`` block of a flat batch mask
    (the blocks one after the other, as ``AttnBatch.custom_mask``); returns a new flat mask."""
    parts = []
    off = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        parts.append(fold(custom_mask[off : off + ql * kl].view(ql, kl)).reshape(-1))
        off += ql * kl
    return torch.cat(parts) if parts else custom_mask[:0].clone()


def refill(dst: BatchSnapshot, src: BatchSnapshot) -> None:
    """Copy the newer, checked snapshot ``src`` into the buffers of ``dst`` (a CUDA-graph
    plan's own snapshot, which a captured graph reads), without moving any of them.

    Every tensor keeps its shape, except that ``dst.kv_indices`` and ``dst.custom_mask`` may
    be longer than ``src``'s (capacity reserved at capture): the kernels find the entries
    through ``kv_indptr``/``mask_indptr``. Checks everything before writing anything.
    """
    if src.phase is not dst.phase or src.page_size != dst.page_size:
        raise InvalidBatchError(
            "phase",
            f"{src.phase.name} batch at page_size {src.page_size!r} into a plan for "
            f"{dst.phase.name} at page_size {dst.page_size!r}",
        )
    if src.num_requests != dst.num_requests:
        raise InvalidBatchError(
            "num_requests",
            f"{src.num_requests} requests into a plan captured for {dst.num_requests}; capture "
            "one graph per batch size (pad the batch to a captured size)",
        )
    pairs = [
        ("qo_indptr", dst.qo_indptr, src.qo_indptr, False),
        ("kv_indptr", dst.kv_indptr, src.kv_indptr, False),
        ("kv_lens", dst.kv_lens, src.kv_lens, False),
        ("kv_indices", dst.kv_indices, src.kv_indices, True),
    ]
    if (src.custom_mask is None) != (dst.custom_mask is None):
        raise InvalidBatchError(
            "custom_mask",
            "a plan captured with (without) a custom mask replays only with (without)",
        )
    if src.custom_mask is not None and dst.custom_mask is not None:
        assert src.mask_indptr is not None and dst.mask_indptr is not None
        pairs.append(("custom_mask", dst.custom_mask, src.custom_mask, True))
        pairs.append(("mask_indptr", dst.mask_indptr, src.mask_indptr, False))
    for name, d, s, grows in pairs:
        fits = s.numel() <= d.numel() if grows else s.shape == d.shape
        if not fits:
            raise InvalidBatchError(
                name,
                f"{s.numel()} entries do not fit the captured buffer of {d.numel()}; capture "
                "with a larger capacity (max pages per request) or run this batch eagerly",
            )
    for _, d, s, _grows in pairs:
        d[: s.numel()].copy_(s, non_blocking=True)
    if dst.qo_indptr_host is not dst.qo_indptr:
        for d, s in (
            (dst.qo_indptr_host, src.qo_indptr_host),
            (dst.kv_indptr_host, src.kv_indptr_host),
            (dst.kv_lens_host, src.kv_lens_host),
        ):
            d.copy_(s)
    dst.step.follow(src.step)  # the captured plan's private snapshot: only its counts change
