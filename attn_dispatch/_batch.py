"""AttnBatch: the paged-KV metadata of one forward, shared by every layer.

torch is imported inside functions only, so `import attn_dispatch` stays torch-free; an
AttnBatch always holds tensors, so torch is loaded by the time one exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch._values import INT32_MAX
from attn_dispatch._values import as_int

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class AttnBatch:
    """Paged attention metadata for one forward (the data contract of every handler).

    Request ``i`` has query rows ``qo_indptr[i]:qo_indptr[i+1]`` and pages
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; token ``t`` is in page
    ``kv_indices[kv_indptr[i] + t // page_size]``, slot ``t % page_size``. ``kv_lens`` counts
    the new tokens too (already written to the cache). ``custom_mask`` is the concatenation of
    row-major ``[q_len_i, kv_len_i]`` blocks; without it attention is causal, bottom-right
    aligned. Build one with ``AttnBatch.build`` from plain lists.

    Validated on construction; each failure is an ``InvalidBatchError`` naming the field and
    the request. ``num_pages`` (the cache's page count), when given, bounds ``kv_indices``;
    ``page_size``, when given, checks that each request has pages for all its tokens.
    """

    phase: Phase
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    custom_mask: torch.Tensor | None = None
    page_size: int | None = None
    num_pages: int | None = None
    # Derived on construction (host-side copies are the ones planning reads).
    mask_indptr: torch.Tensor | None = dataclasses.field(init=False, default=None)
    qo_indptr_host: torch.Tensor = dataclasses.field(init=False)
    kv_indptr_host: torch.Tensor = dataclasses.field(init=False)
    kv_lens_host: torch.Tensor = dataclasses.field(init=False)
    num_requests: int = dataclasses.field(init=False)
    num_tokens: int = dataclasses.field(init=False)
    max_q_len: int = dataclasses.field(init=False)
    max_kv_len: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.phase, Phase):
            raise InvalidBatchError("phase", f"expected a Phase, got {self.phase!r}")
        if self.page_size is not None:
            as_int(self.page_size, "page_size", low=1)
        if self.num_pages is not None:
            as_int(self.num_pages, "num_pages", low=0)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_lens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise InvalidBatchError(name, f"expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise InvalidBatchError(name, f"dtype must be torch.int32, got {t.dtype}")
            if t.dim() != 1:
                raise InvalidBatchError(name, f"must be 1-D, got shape {tuple(t.shape)}")
        from attn_dispatch import _contract  # torch is loaded: tensors exist

        qo = self.qo_indptr.cpu()
        kv = self.kv_indptr.cpu()
        lens = self.kv_lens.cpu()
        put = object.__setattr__
        put(self, "qo_indptr_host", qo)
        put(self, "kv_indptr_host", kv)
        put(self, "kv_lens_host", lens)
        put(self, "num_requests", lens.numel())
        total, max_q, max_kv = _contract.check_metadata(
            self.phase, qo, kv, lens, self.kv_indices.numel(), self.page_size
        )
        _contract.check_indices(kv, self.kv_indices.cpu(), self.num_pages)
        put(self, "num_tokens", total)
        put(self, "max_q_len", max_q)
        put(self, "max_kv_len", max_kv)
        if self.custom_mask is not None:  # without one, VERIFY is a causal chain
            offsets, _ = _contract.mask_offsets(self.custom_mask, qo, lens, rows=True)
            put(self, "mask_indptr", offsets.to(self.custom_mask.device))

    # -- builders -----------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        phase: Phase,
        *,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        page_size: int,
        num_pages: int | None = None,
        masks: Sequence[Any] | None = None,
        device: Any = "cpu",
    ) -> AttnBatch:
        """Build from plain per-request data.

        >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9],
        ...                         page_tables=[[3], [0, 7]], page_size=8)
        >>> batch.kv_indptr, batch.kv_indices
        (tensor([0, 1, 3], dtype=torch.int32), tensor([3, 0, 7], dtype=torch.int32))

        ``masks`` (VERIFY trees) is one bool ``[q_len_i, kv_len_i]`` block per request, e.g.
        from ``tree_mask``.
        """
        import torch

        n = len(kv_lens)
        if len(q_lens) != n or len(page_tables) != n:
            raise InvalidBatchError(
                "q_lens",
                f"q_lens ({len(q_lens)}), kv_lens ({n}) and page_tables ({len(page_tables)}) "
                "must have one entry per request",
            )
        # Every value an int in int32's range (the index tensors are int32): a float length
        # is refused, never truncated, and a huge one is our error, not torch's.
        page_size = as_int(page_size, "page_size", low=1)
        q_lens = [as_int(q, "q_lens", request=i) for i, q in enumerate(q_lens)]
        kv_lens = [as_int(k, "kv_lens", request=i) for i, k in enumerate(kv_lens)]
        qo = [0]
        kv = [0]
        flat: list[int] = []
        for i, (q, table) in enumerate(zip(q_lens, page_tables, strict=True)):
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + len(table))
            flat.extend(as_int(p, "page_tables", request=i) for p in table)
        for name, ptr in (("q_lens", qo), ("page_tables", kv)):
            if ptr[-1] > INT32_MAX:
                raise InvalidBatchError(
                    name, f"the batch totals {ptr[-1]} entries, past int32's {INT32_MAX}"
                )
        mask = None
        if masks is not None:
            if len(masks) != n:
                raise InvalidBatchError("masks", f"{len(masks)} masks for {n} requests")
            parts = [torch.as_tensor(m, dtype=torch.bool).reshape(-1) for m in masks]
            mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
            for i, (m, q, k) in enumerate(zip(masks, q_lens, kv_lens, strict=True)):
                if tuple(torch.as_tensor(m).shape) != (q, k):
                    raise InvalidBatchError(
                        "masks",
                        f"shape {tuple(torch.as_tensor(m).shape)} != (q_len, kv_len) = ({q}, {k})",
                        request=i,
                    )
        i32 = torch.int32
        batch = cls(
            phase=phase,
            qo_indptr=torch.tensor(qo, dtype=i32),
            kv_indptr=torch.tensor(kv, dtype=i32),
            kv_indices=torch.tensor(flat, dtype=i32),
            kv_lens=torch.tensor(kv_lens, dtype=i32),
            custom_mask=mask,
            page_size=page_size,
            num_pages=num_pages,
        )
        return batch if str(device) == "cpu" else batch.to(device)

    @classmethod
    def _of_checked(
        cls,
        phase: Phase,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        *,
        page_size: int,
        num_tokens: int,
        max_q_len: int,
        max_kv_len: int,
    ) -> AttnBatch:
        """A CPU batch without a mask from int32 index tensors that the caller built from
        values it checked to this contract itself, with their counts: no second check (an
        integration's step builder, ``integrations.vllm._steps.batch_from_lists``, which
        names each problem in its framework's terms first). As for ``_derive``, the caller
        keeps the contract, and every backend checks its own snapshot again when it plans."""
        new = AttnBatch.__new__(AttnBatch)
        put = object.__setattr__
        for name, value in (
            ("phase", phase),
            ("qo_indptr", qo_indptr),
            ("kv_indptr", kv_indptr),
            ("kv_indices", kv_indices),
            ("kv_lens", kv_lens),
            ("custom_mask", None),
            ("page_size", page_size),
            ("num_pages", None),
            ("mask_indptr", None),
            ("qo_indptr_host", qo_indptr),
            ("kv_indptr_host", kv_indptr),
            ("kv_lens_host", kv_lens),
            ("num_requests", kv_lens.numel()),
            ("num_tokens", num_tokens),
            ("max_q_len", max_q_len),
            ("max_kv_len", max_kv_len),
        ):
            put(new, name, value)
        return new

    def to(self, device: Any) -> AttnBatch:
        """The same batch with its device tensors on ``device`` (host copies stay on CPU)."""
        moved = {}
        for name in _DEVICE_FIELDS:
            t = getattr(self, name)
            if t is not None:
                moved[name] = t.to(device, non_blocking=True)
        return self._derive(**moved)

    def _derive(self, **changes: Any) -> AttnBatch:
        """A copy of this checked batch with some fields replaced, derived fields included,
        without checking again: the one way the package copies a batch (``to``, and the
        CUDA-graph layouts of ``attn_dispatch.cuda_graph``). The caller keeps the contract;
        every backend checks its own snapshot again when it plans."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"AttnBatch has no field {sorted(unknown)[0]!r}")
        new = AttnBatch.__new__(AttnBatch)
        for name in _FIELD_NAMES:
            object.__setattr__(new, name, changes.get(name, getattr(self, name)))
        return new

    def ragged(self) -> AttnBatch:
        """This batch over ragged K/V rows (page_size 1): request i's keys are rows
        ``cumsum(kv_lens)[i-1]:cumsum(kv_lens)[i]`` of a ``[sum(kv_lens), H, D]`` tensor.

        Used for the decompressed MHA form of MLA layers; built from host copies only.
        """
        import torch

        lens = self.kv_lens_host.to(torch.int64)
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=indptr[1:])
        total = int(indptr[-1])
        dev = self.kv_indices.device
        out = AttnBatch(
            phase=self.phase,
            qo_indptr=self.qo_indptr_host,
            kv_indptr=indptr.to(torch.int32),
            kv_indices=torch.arange(total, dtype=torch.int32),
            kv_lens=self.kv_lens_host,
            custom_mask=None if self.custom_mask is None else self.custom_mask.cpu(),
            page_size=1,
            num_pages=total,
        )
        return out if dev.type == "cpu" else out.to(dev)

    @property
    def device(self) -> Any:
        return self.qo_indptr.device

    def q_lens(self) -> list[int]:
        """Query tokens per request (host)."""
        return (self.qo_indptr_host[1:] - self.qo_indptr_host[:-1]).tolist()


_DEVICE_FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_lens", "custom_mask", "mask_indptr")
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(AttnBatch))


def tree_mask(parents: Sequence[int], prefix_len: int) -> torch.Tensor:
    """The verify mask of one request: draft token ``j`` sees the prefix, its ancestors, itself.

    ``parents[j]`` is the index of token ``j``'s parent among the draft tokens, or -1 when its
    parent is the last token of the prefix. Returns bool ``[q, prefix_len + q]``. Parents must
    come before their children, so every row sees at least itself.

    >>> tree_mask([-1, 0, 0], prefix_len=4).int()   # a root with two children
    tensor([[1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 0, 1]], dtype=torch.int32)
    """
    import torch

    q = len(parents)
    if prefix_len < 0:
        raise InvalidBatchError("prefix_len", f"must be >= 0, got {prefix_len!r}")
    mask = torch.zeros(q, prefix_len + q, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise InvalidBatchError(
                "parents", f"token {j} has parent {p!r}; a parent is -1 or an earlier token index"
            )
        mask[j, prefix_len + j] = True
        if p >= 0:
            mask[j, prefix_len : prefix_len + q] |= mask[p, prefix_len : prefix_len + q]
    return mask


# Public through attn_dispatch (loaded lazily there): reprs and pickles name it.
AttnBatch.__module__ = tree_mask.__module__ = "attn_dispatch"
# doctest looks for an object's examples in the module its __module__ names, where these are
# loaded lazily (not in its namespace): list them here so that their examples run.
__test__ = {"AttnBatch.build": AttnBatch.build, "tree_mask": tree_mask}
