"""Writing a step's new K and V rows into paged caches in one C call (``na_kv_write``).

A serving engine writes each layer's new keys and values at their slots before attention
reads them. In torch that is two ``index_copy_`` per layer (plus, for a padded slot mapping,
the rows of the real slots and a gather of their tokens); here it is one call into the
native library, which checks every tensor's description and every slot against the caches
before it writes a byte (csrc/native_attn.h ``NaKvWriteArgs``).

``kv_writer()`` is the write, or None when the native library is not built (callers then
keep their torch path).
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backends.native._lib import KV_WRITE_ARGS
from attn_dispatch.backends.native._lib import NaStatus
from attn_dispatch.backends.native._lib import load

#: csrc/native_attn.h NA_F32 / NA_BF16 / NA_F16: the dtypes a KV write takes (FP8 caches are
#: written by the caller, which converts and scales first).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KvCaches:
    """A K and a V cache described once for ``na_kv_write`` (``KvCaches.of``): a serving
    layer writes into the same caches every step, so their half of the call's arguments is
    packed once. The tensors are held, so the description stays theirs (a cache resized in
    place needs a new ``KvCaches``)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_step: int
    #: The caches' fields of ``NaKvWriteArgs`` in order (``k_cache`` .. ``reserved2``).
    fields: tuple[Any, ...]

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, page_step: int) -> KvCaches:
        """``k_cache`` and ``v_cache`` (``[pages, page_size, heads, head_dim]``) with slot
        ``s``'s rows at page ``(s // page_size) * page_step`` (see ``kv_writer``); what does
        not fit is refused by the write."""
        try:
            fields: tuple[Any, ...] = (
                k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape, *k_cache.stride(),
                *v_cache.shape, *v_cache.stride(), page_step, DTYPE_CODES.get(k_cache.dtype, -1),
                DTYPE_CODES.get(v_cache.dtype, -1), k_cache.is_cpu and v_cache.is_cpu, 0,
            )  # fmt: skip
        except (AttributeError, TypeError):
            fields = ()  # not tensors: packs nothing, the write refuses them
        return cls(k_cache, v_cache, page_step, fields)


#: ``write(key, value, slot_mapping, caches)``: see ``kv_writer``.
KvWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KvCaches], None]


def kv_writer(library: str | None = None) -> KvWrite | None:
    """The native KV write, or None when the library does not load.

    ``write(key, value, slot_mapping, caches)``: for each token ``i`` of ``slot_mapping``
    (int64 ``[n]``; any other integer dtype is converted) whose slot ``s`` is not negative
    (negative: padding, that token is skipped), the rows ``key[i]`` and ``value[i]`` (``[>= n,
    heads, head_dim]``, any strides) go to row ``s % page_size`` of page ``(s // page_size) *
    page_step`` of ``caches.k_cache`` and ``caches.v_cache`` (contiguous ``[pages, page_size,
    heads, head_dim]``, one shape; ``KvCaches.of``), every tensor of one dtype (float32,
    bfloat16 or float16) on the CPU. What ``index_copy_`` of those rows would write, nothing
    else.

    A slot whose page lies past the caches' last page raises ``InvalidBatchError`` naming
    ``slot_mapping`` and the token, tensors that do not fit one another an
    ``InvalidBatchError`` naming them; either way nothing is written (the library checks
    every slot and description first).
    """
    lib = load(library)
    if isinstance(lib, str):
        return None
    run = lib.cdll.na_kv_write
    pack = KV_WRITE_ARGS.pack
    codes = DTYPE_CODES
    int64 = torch.int64

    def write(
        key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, caches: KvCaches
    ) -> None:
        slots = slot_mapping
        try:
            if slots.dtype is not int64:
                slots = _int64(slots)
            args = pack(
                key.data_ptr(), value.data_ptr(), slots.data_ptr(), *key.shape, *key.stride(),
                *value.shape, *value.stride(), *slots.shape, *slots.stride(),
                codes.get(key.dtype, -1), codes.get(value.dtype, -1),
                key.is_cpu and value.is_cpu and slots.is_cpu, 0, *caches.fields,
            )  # fmt: skip
        except (struct.error, AttributeError, TypeError):
            args = None  # not tensors of the ranks described (a 2-D slot mapping, ...)
        if args is not None and run(args, None) == NaStatus.OK:
            return
        bad = ctypes.c_int64(-1)
        if args is not None and run(args, ctypes.byref(bad)) == NaStatus.OK:
            return  # not reached: the library refuses the same arguments again
        raise _refusal(bad.value, key, value, slots, caches)

    return write


def _int64(slots: torch.Tensor) -> torch.Tensor:
    """An integer slot mapping as int64; ``TypeError`` for any other dtype (refused)."""
    dtype = slots.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError("slot_mapping")
    return slots.to(torch.int64)


def _refusal(bad: int, key: Any, value: Any, slots: Any, caches: KvCaches) -> InvalidBatchError:
    """The error for a refused write: the first slot outside the caches, or the tensors."""
    k_cache, v_cache, page_step = caches.k_cache, caches.v_cache, caches.page_step
    if bad >= 0:
        slot = int(slots[bad])
        pages, page_size = k_cache.shape[0], k_cache.shape[1]
        return InvalidBatchError(
            "slot_mapping",
            f"token {bad}'s slot {slot} is block {slot // page_size}, page "
            f"{slot // page_size * page_step}, past the KV cache's {pages} pages of "
            f"{page_size} slots (page step {page_step}); nothing was written",
        )

    def describe(t: Any) -> str:
        if not isinstance(t, torch.Tensor):
            return type(t).__name__
        return f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"

    return InvalidBatchError(
        "key",
        "the KV write takes key and value [>= tokens, heads, head_dim] and caches [pages, "
        "page_size, heads, head_dim] (contiguous, one shape), all float32, bfloat16 or "
        "float16 alike on the CPU, a 1-D integer slot mapping and page_step >= 1; got key "
        f"{describe(key)}, value {describe(value)}, k_cache {describe(k_cache)}, v_cache "
        f"{describe(v_cache)}, slot_mapping {describe(slots)}, page_step {page_step!r}; "
        "nothing was written",
    )


__all__ = ["DTYPE_CODES", "KvCaches", "KvWrite", "kv_writer"]
