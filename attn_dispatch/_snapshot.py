"""``BatchSnapshot``: what a plan keeps of a batch, checked at the bound page size.

At plan time a backend takes private contiguous copies of the index tensors a kernel will read,
re-checked with the contract's rules (``attn_dispatch._contract``). A plan holds the snapshot,
so editing the batch's tensors after planning never reaches a kernel, and a batch built without
``page_size`` is still checked against the pages it names. ``refill`` copies a newer snapshot
into a CUDA-graph-captured plan's buffers.

>>> from attn_dispatch import AttnBatch, Phase
>>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9],
...                         page_tables=[[3], [0, 1]], page_size=8)
>>> snap = BatchSnapshot.of(batch, 8)          # once per forward, at the bound page size
>>> snap.num_tokens, snap.max_kv_len, snap.max_page
(2, 9, 3)

On a CUDA batch the snapshot copies the index tensors on the device (no host sync) and checks
the host copies only; page index values stay unknown (``max_page is None``) unless the
backend asks for ``check_device=True`` (its ``validate`` option), so GPU kernels must mask
out-of-range pages themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attn_dispatch._contract import _LIST_MAX
from attn_dispatch._contract import _LIST_MAX_INDICES
from attn_dispatch._contract import _verdict_lists
from attn_dispatch._contract import check_indices
from attn_dispatch._contract import check_metadata
from attn_dispatch._contract import mask_offsets
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase

__all__ = ["BatchSnapshot", "StepStats", "refill"]

_I32 = torch.int32


def _index_tensor(batch: Any, name: str) -> torch.Tensor:
    t = getattr(batch, name, None)
    if not isinstance(t, torch.Tensor) or t.dtype != _I32 or t.dim() != 1:
        what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} {t.dim()}-D"
        raise InvalidBatchError(name, f"must be a 1-D torch.int32 tensor, got {what}")
    return t


class StepStats:
    """The counts of one step that a CUDA-graph-captured plan follows from replay to replay
    (``refill``): the only part of a snapshot that ever changes, kept apart from the frozen
    value so that nothing mutates a frozen object. Only ``follow`` changes them: plain
    attribute assignment is refused, as on a frozen dataclass (the per-call checks compare
    the cache with ``max_page``; a plan is a value, see attn_dispatch._plans)."""

    __slots__ = ("max_kv_len", "max_page", "max_q_len", "num_tokens")

    num_tokens: int
    max_q_len: int
    max_kv_len: int
    max_page: int | None

    def __init__(self, num_tokens: int, max_q_len: int, max_kv_len: int, max_page: int | None):
        self._set(num_tokens, max_q_len, max_kv_len, max_page)

    def _set(self, num_tokens: int, max_q_len: int, max_kv_len: int, max_page: int | None) -> None:
        put = object.__setattr__
        put(self, "num_tokens", num_tokens)
        put(self, "max_q_len", max_q_len)
        put(self, "max_kv_len", max_kv_len)
        put(self, "max_page", max_page)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"StepStats.{name} is read-only: a snapshot's counts change only when a captured "
            "plan follows a new step (follow)"
        )

    def __reduce__(self) -> tuple[type[StepStats], tuple[int, int, int, int | None]]:
        # copy and pickle rebuild through __init__ (slot state would go through __setattr__)
        return StepStats, (self.num_tokens, self.max_q_len, self.max_kv_len, self.max_page)

    def follow(self, other: StepStats) -> None:
        """Take ``other``'s counts (a captured plan replaying a new step)."""
        self._set(other.num_tokens, other.max_q_len, other.max_kv_len, other.max_page)


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


# Public through attn_dispatch.backend (loaded lazily there): reprs and pickles name it.
BatchSnapshot.__module__ = refill.__module__ = "attn_dispatch.backend"
