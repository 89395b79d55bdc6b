"""``na_kv_write`` (ABI 10): a step's K and V rows written at their slots in one C call.

What it writes is what ``index_copy_`` of the same rows writes (padding slots skipped, strided
key and value, K and V pages interleaved or not); a slot past the caches, or tensors that do
not fit, are refused with ``InvalidBatchError`` and nothing is written, checked in C before
the first byte.
"""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch.backends.native._lib import KV_WRITE_ARGS  # noqa: E402
from attn_dispatch.backends.native._lib import NaKvWriteArgs  # noqa: E402
from attn_dispatch.backends.native._lib import NaStatus  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from tests.backends.native.packing import assert_packs_as_struct  # noqa: E402

LIB = load()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")

H, D, PS, BLOCKS = 2, 8, 4, 5


def _writer() -> object:
    from attn_dispatch.backends.native.kv_write import kv_writer

    write = kv_writer()
    assert write is not None
    return write


def _interleaved(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's memory of ``BLOCKS`` blocks, K page then V page per block (vLLM's CPU
    layout as pages): (memory, k pages, v pages), v the same memory shifted by one page."""
    mem = torch.randn(BLOCKS, 2, PS, H, D).to(dtype)
    flat = mem.view(-1)
    page = PS * H * D
    count = 2 * BLOCKS - 1
    k = flat[: count * page].view(count, PS, H, D)
    v = flat[page : page + count * page].view(count, PS, H, D)
    return mem, k, v


def _fused(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value as column slices of one [tokens, q + k + v] projection (strided rows)."""
    qkv = torch.randn(tokens, 3 * H * D).to(dtype)
    _, k, v = qkv.split([H * D, H * D, H * D], dim=-1)
    return k.view(tokens, H, D), v.view(tokens, H, D)


def _by_index_copy(
    mem: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """What the torch path writes: rows 2 * PS * b + s % PS of the K and V row views."""
    want = mem.clone()
    flat = want.view(-1)
    page = PS * H * D
    count = 2 * BLOCKS - 1
    rows_k = flat[: count * page].view(-1, H, D)
    rows_v = flat[page : page + count * page].view(-1, H, D)
    keep = [i for i, s in enumerate(slots) if s >= 0]
    rows = torch.tensor([slots[i] // PS * 2 * PS + slots[i] % PS for i in keep], dtype=torch.int64)
    rows_k.index_copy_(0, rows, key[keep])
    rows_v.index_copy_(0, rows, value[keep])
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "slots",
    [
        [0, 5, 19, 7],  # first slot, a later block, the last slot of the last block
        [3, -1, 12, -1, -1],  # padding (vLLM's -1) among real slots
        [-1, -1],  # padding only: nothing is written
        [],
    ],
)
def test_writes_what_index_copy_writes(dtype: torch.dtype, slots: list[int]) -> None:
    from attn_dispatch.backends.native.kv_write import KvCaches

    mem, k, v = _interleaved(dtype)
    # Two more token rows than slots: only the first len(slots) are written.
    key, value = _fused(len(slots) + 2, dtype)
    want = _by_index_copy(mem, key[: len(slots)], value[: len(slots)], slots)
    _writer()(key, value, torch.tensor(slots, dtype=torch.int64), KvCaches.of(k, v, 2))
    assert torch.equal(mem.view(torch.uint8), want.view(torch.uint8))
    if any(s >= 0 for s in slots):
        assert not torch.equal(mem, _interleaved(dtype)[0])  # something was written


def test_contiguous_caches_page_step_one_and_int32_slots() -> None:
    """Page step 1 (a K and a V cache of their own): slot s at page s // PS, row s % PS; an
    int32 slot mapping is read as int64; contiguous key and value."""
    from attn_dispatch.backends.native.kv_write import KvCaches

    kc = torch.zeros(3, PS, H, D)
    vc = torch.zeros(3, PS, H, D)
    key, value = torch.randn(3, H, D), torch.randn(3, H, D)
    _writer()(key, value, torch.tensor([9, -1, 2], dtype=torch.int32), KvCaches.of(kc, vc, 1))
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k.view(-1, H, D)[[9, 2]] = key[[0, 2]]
    want_v.view(-1, H, D)[[9, 2]] = value[[0, 2]]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_heads_and_dims_at_any_stride() -> None:
    """key with heads not dense (a [tokens, D, H] tensor transposed) and value with its last
    dim strided: the same rows as index_copy_."""
    from attn_dispatch.backends.native.kv_write import KvCaches

    mem, k, v = _interleaved(torch.float32)
    key = torch.randn(3, D, H).transpose(1, 2)  # strides (D * H, 1, H)
    value = torch.randn(3, H, 2 * D)[:, :, ::2]  # strides (2 * H * D, 2 * D, 2)
    slots = [1, 10, 17]
    want = _by_index_copy(mem, key, value, slots)
    _writer()(key, value, torch.tensor(slots), KvCaches.of(k, v, 2))
    assert torch.equal(mem, want)


@pytest.mark.parametrize("bad", [BLOCKS * PS, BLOCKS * PS + 3, 2**62, 2**63 - 1])
def test_a_slot_past_the_cache_is_refused_and_nothing_is_written(bad: int) -> None:
    from attn_dispatch.backends.native.kv_write import KvCaches

    mem, k, v = _interleaved(torch.bfloat16)
    before = mem.clone()
    key, value = _fused(4, torch.bfloat16)
    # Valid slots before and after the bad one: none of them is written either.
    slots = torch.tensor([0, 6, bad, 13], dtype=torch.int64)
    with pytest.raises(InvalidBatchError) as info:
        _writer()(key, value, slots, KvCaches.of(k, v, 2))
    assert info.value.field == "slot_mapping"
    assert f"token 2's slot {bad}" in str(info.value)
    assert torch.equal(mem.view(torch.uint8), before.view(torch.uint8))


def test_the_last_block_is_inside_with_page_step_two() -> None:
    """With K and V interleaved the last block's K page is the view's last page (2b, the V
    view shifted by one): its slots are written, the next block's are refused."""
    from attn_dispatch.backends.native.kv_write import KvCaches

    mem, k, v = _interleaved(torch.float32)
    key, value = torch.randn(1, H, D), torch.randn(1, H, D)
    last = BLOCKS * PS - 1
    _writer()(key, value, torch.tensor([last]), KvCaches.of(k, v, 2))
    assert torch.equal(mem[BLOCKS - 1, 0, PS - 1], key[0])
    assert torch.equal(mem[BLOCKS - 1, 1, PS - 1], value[0])
    with pytest.raises(InvalidBatchError, match="slot_mapping"):
        _writer()(key, value, torch.tensor([last + 1]), KvCaches.of(k, v, 2))


def _refused(**over: object) -> None:
    """The write with one argument replaced is refused naming the tensors; nothing written."""
    from attn_dispatch.backends.native.kv_write import KvCaches

    kc, vc = torch.zeros(3, PS, H, D), torch.zeros(3, PS, H, D)
    args: dict[str, object] = dict(
        key=torch.randn(2, H, D), value=torch.randn(2, H, D), k_cache=kc, v_cache=vc,
        slots=torch.tensor([1, 2]), page_step=1,
    )  # fmt: skip
    args.update(over)
    caches = KvCaches.of(args["k_cache"], args["v_cache"], args["page_step"])  # type: ignore[arg-type]
    with pytest.raises(InvalidBatchError) as info:
        _writer()(args["key"], args["value"], args["slots"], caches)
    assert info.value.field == "key" and "nothing was written" in str(info.value)
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize(
    "over",
    [
        {"key": torch.randn(2, H, D, dtype=torch.float64)},  # a dtype the write does not take
        {"value": torch.randn(2, H, D, dtype=torch.bfloat16)},  # dtypes differ
        {"key": torch.randn(1, H, D)},  # fewer rows than slots
        {"value": torch.randn(2, H + 1, D)},  # other heads than the cache
        {"key": torch.randn(2, H * D)},  # another rank
        {"k_cache": torch.zeros(3, PS, H, 2 * D)[..., ::2]},  # a cache that is not contiguous
        {"v_cache": torch.zeros(4, PS, H, D)},  # caches of two shapes
        {"k_cache": torch.zeros(3, PS, H, D, dtype=torch.float8_e4m3fn)},  # FP8: the caller's
        {"slots": torch.tensor([[1, 2]])},  # a 2-D slot mapping
        {"slots": torch.tensor([1.0, 2.0])},  # float slots are not converted
        {"page_step": 0},
        {"page_step": "2"},
        {"key": None},
    ],
)
def test_tensors_that_do_not_fit_are_refused(over: dict[str, object]) -> None:
    _refused(**over)


def test_the_packed_bytes_are_the_ctypes_struct() -> None:
    """KV_WRITE_ARGS packs the fields of NaKvWriteArgs in order, at the library's layout."""
    assert_packs_as_struct(KV_WRITE_ARGS, NaKvWriteArgs)
    assert not isinstance(LIB, str)
    assert LIB.cdll.na_struct_size(b"NaKvWriteArgs") == ctypes.sizeof(NaKvWriteArgs)


def test_a_null_description_is_refused_by_the_library() -> None:
    assert not isinstance(LIB, str)
    bad = ctypes.c_int64(7)
    assert LIB.cdll.na_kv_write(None, ctypes.byref(bad)) == NaStatus.BAD_ARGS
    assert bad.value == -1
