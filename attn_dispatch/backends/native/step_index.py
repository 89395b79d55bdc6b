"""A serving step's batch index arrays in one C call (``na_step_index``).

A serving engine hands each step as a few small tensors (vLLM: ``query_start_loc``,
``seq_lens``, a block table). Turning them into a batch's index vectors in Python reads
each one to the host, checks it and rebuilds it as int32 tensors: some twenty torch and
interpreter operations per step, whose cost grows when the kernels between steps have
evicted the interpreter's working set. Here one call into the native library checks every
value it reads and writes the four vectors into one int32 tensor (csrc/native_attn.h
``NaStepArgs``).

The call only accepts: a step it refuses (any rule broken, a dtype other than int32/int64,
a tensor of another rank) returns None, and the caller's own checks name the problem.
``step_indexer()`` is None when the native library is not built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from collections.abc import Callable

import torch

from attn_dispatch.backends.native._lib import STEP_ARGS
from attn_dispatch.backends.native._lib import NaStatus
from attn_dispatch.backends.native._lib import NaStepInfo
from attn_dispatch.backends.native._lib import load

#: csrc/native_attn.h ``NaStepArgs`` dtype codes.
_DTYPES = {torch.int32: 0, torch.int64: 1}
#: Blocks the first buffer holds beyond the offsets (a larger step takes a second call).
_FIRST_PAGES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class StepIndex:
    """One step's batch index vectors, views of one int32 tensor: ``qo_indptr`` [R + 1]
    (query offsets from 0), ``kv_indptr`` [R + 1] (running sum of the blocks each request
    reads), ``kv_lens`` [R] and ``kv_indices`` [num_pages] (``2 * block id``: the K page of
    each block read, V the next page), for all R requests of the step; with what the call
    found: the step's first query row, its query rows in all, the shortest and longest query,
    the longest sequence and the smallest number of cached tokens (``seq_lens[i]`` minus the
    query length)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor
    first_token: int
    num_tokens: int
    min_q: int
    max_q: int
    max_kv: int
    min_cached: int


#: ``index(query_start_loc, seq_lens, block_table, block_size)``: see ``step_indexer``.
StepIndexer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], "StepIndex | None"]


def step_indexer(library: str | None = None) -> StepIndexer | None:
    """The native step index, or None when the library does not load.

    ``index(query_start_loc, seq_lens, block_table, block_size)``: request ``i``'s query rows
    are ``query_start_loc[i] .. query_start_loc[i + 1]`` (``[R + 1]``), it holds
    ``seq_lens[i]`` tokens (``[R]``, cached and new) in the blocks ``block_table[i, :need]``
    (``[>= R, cols]``), ``need = ceil(seq_lens[i] / block_size)`` for a request with a query
    token, none without. Each tensor int32 or int64, on the CPU, any strides.

    Returns a ``StepIndex``, or None unless every rule holds: offsets from 0 or later that
    never decrease, ``seq_lens[i]`` at least the query length, ``need <= cols``, block ids in
    ``[0, 2**30)``, every value of the vectors within int32. Nothing is read outside the
    tensors as described.

    >>> import torch
    >>> index = step_indexer()
    >>> i32 = torch.int32
    >>> found = index(torch.tensor([0, 1, 2], dtype=i32), torch.tensor([5, 9], dtype=i32),
    ...               torch.tensor([[3, 0], [4, 7]], dtype=i32), 8)
    >>> found.kv_indices.tolist(), found.kv_indptr.tolist(), found.max_q
    ([6, 8, 14], [0, 1, 3], 1)
    """
    lib = load(library)
    if isinstance(lib, str):
        return None
    run = lib.cdll.na_step_index
    pack = STEP_ARGS.pack
    codes = _DTYPES
    ok, short = int(NaStatus.OK), int(NaStatus.SHORT_BUFFER)

    def index(
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
    ) -> StepIndex | None:
        try:
            qsl, seq, bt = query_start_loc, seq_lens, block_table
            host = qsl.is_cpu and seq.is_cpu and bt.is_cpu
            requests = qsl.shape[0] - 1
            cap = 3 * requests + 2 + min(requests * bt.shape[1], _FIRST_PAGES)
            ptrs = (qsl.data_ptr(), seq.data_ptr(), bt.data_ptr())
            dims = (
                *qsl.shape, *qsl.stride(), *seq.shape, *seq.stride(), *bt.shape, *bt.stride(),
                block_size,
            )  # fmt: skip
            dtypes = (codes.get(qsl.dtype, -1), codes.get(seq.dtype, -1), codes.get(bt.dtype, -1))
            info = NaStepInfo()
            out = torch.empty(max(cap, 0), dtype=torch.int32)
            rc = run(pack(*ptrs, out.data_ptr(), *dims, cap, *dtypes, host), ctypes.byref(info))
            if rc == short:
                cap = info.out_used
                out = torch.empty(cap, dtype=torch.int32)
                rc = run(pack(*ptrs, out.data_ptr(), *dims, cap, *dtypes, host), ctypes.byref(info))
        except (struct.error, AttributeError, TypeError, IndexError, OverflowError):
            return None  # not tensors of the ranks described, or a size no int64 holds
        if rc != ok:
            return None
        r, used = info.num_requests, info.out_used
        # The buffer's unused tail as a fifth view: one op fewer than slicing it off first.
        qo, kv, lens, idx, _ = out.split_with_sizes((r + 1, r + 1, r, info.num_pages, cap - used))
        return StepIndex(
            qo, kv, lens, idx, info.first_token, info.num_tokens, info.min_q, info.max_q,
            info.max_kv, info.min_cached,
        )  # fmt: skip

    return index


__all__ = ["StepIndex", "StepIndexer", "step_indexer"]
