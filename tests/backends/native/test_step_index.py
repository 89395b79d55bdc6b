"""``na_step_index`` (ABI 11): a serving step's batch index vectors in one C call.

It writes what the Python step builder writes (``attn_dispatch.integrations.vllm._steps``:
the same vectors from the same tensors, at any strides, int32 or int64), or refuses: any
broken rule, any other dtype, rank or device gives None, never a partial answer. The
builder's own checks then name the problem (``tests/integrations/vllm/test_steps.py``
holds both paths to the same results and the same errors).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch.backends.native import step_index  # noqa: E402
from attn_dispatch.backends.native._lib import STEP_ARGS  # noqa: E402
from attn_dispatch.backends.native._lib import NaStatus  # noqa: E402
from attn_dispatch.backends.native._lib import NaStepArgs  # noqa: E402
from attn_dispatch.backends.native._lib import NaStepInfo  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from tests.backends.native.packing import assert_packs_as_struct  # noqa: E402

LIB = load()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
I32, I64 = torch.int32, torch.int64


def _index() -> Any:
    found = step_index.step_indexer()
    assert found is not None
    return found


def _expected(qsl: list[int], kv: list[int], table: list[list[int]], bs: int) -> dict[str, Any]:
    """The vectors as the rules say, in plain Python."""
    qo, kvp, pages = [0], [0], []
    for i, n in enumerate(kv):
        q = qsl[i + 1] - qsl[i]
        need = -(-n // bs) if q else 0
        pages += [2 * b for b in table[i][:need]]
        qo.append(qsl[i + 1] - qsl[0])
        kvp.append(len(pages))
    return {"qo_indptr": qo, "kv_indptr": kvp, "kv_lens": list(kv), "kv_indices": pages}


def _check(found: Any, want: dict[str, Any]) -> None:
    assert found is not None
    for name, values in want.items():
        got = getattr(found, name)
        assert got.dtype == I32, name
        assert got.tolist() == values, name


@pytest.mark.parametrize("dtypes", [(I32, I32, I32), (I64, I64, I64), (I64, I32, I64)], ids=str)
def test_vectors_and_counts_are_the_rules(dtypes: tuple[torch.dtype, ...]) -> None:
    qsl, kv = [2, 3, 3, 8, 9], [9, 4, 5, 1]
    table = [[3, 5, 8], [7, 0, 0], [1, 2, 0], [4, 0, 0]]
    found = _index()(
        torch.tensor(qsl, dtype=dtypes[0]),
        torch.tensor(kv, dtype=dtypes[1]),
        torch.tensor(table, dtype=dtypes[2]),
        4,
    )
    _check(found, _expected(qsl, kv, table, 4))
    # Request 1 has no query token: it reads no block. Counts over all four requests.
    assert found.kv_indptr.tolist() == [0, 3, 3, 5, 6]
    assert (found.first_token, found.num_tokens) == (2, 7)
    assert (found.min_q, found.max_q, found.max_kv, found.min_cached) == (0, 5, 9, 0)


def test_any_strides_are_read_as_torch_holds_them() -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 1000, (12, 20), generator=g, dtype=I64)
    table = big[1::2, ::3]  # rows and columns at strides of 40 and 3
    qsl = torch.tensor([0, 9, 1, 9, 2, 9, 3, 9, 4, 9, 5, 9, 6], dtype=I32)[::2]
    kv = torch.tensor([[17, 0], [3, 0], [24, 0], [1, 0], [7, 0], [12, 0]], dtype=I32)[:, 0]
    assert not table.is_contiguous() and not qsl.is_contiguous() and not kv.is_contiguous()
    found = _index()(qsl, kv, table, 4)
    _check(found, _expected(qsl.tolist(), kv.tolist(), table.tolist(), 4))
    # A table expanded from one row (stride 0) reads that row for every request.
    row = torch.tensor([[5, 6, 7, 8, 9, 10, 11]], dtype=I32).expand(6, 7)
    _check(_index()(qsl, kv, row, 4), _expected(qsl.tolist(), kv.tolist(), row.tolist(), 4))


def test_a_step_past_the_first_buffer_takes_a_second_call() -> None:
    n = step_index._FIRST_PAGES + 5  # one request reading more blocks than the first buffer
    table = torch.arange(2 * n, dtype=I32).view(2, n)
    found = _index()(torch.tensor([0, 1, 2], dtype=I32), torch.tensor([n, 3], dtype=I32), table, 1)
    _check(found, _expected([0, 1, 2], [n, 3], table.tolist(), 1))
    assert found.kv_indices.numel() == n + 3


def test_an_empty_step() -> None:
    found = _index()(
        torch.tensor([4], dtype=I32), torch.zeros(0, dtype=I32), torch.zeros(0, 3, dtype=I32), 8
    )
    _check(found, {"qo_indptr": [0], "kv_indptr": [0], "kv_lens": [], "kv_indices": []})
    assert (found.num_tokens, found.min_q, found.max_q) == (0, 0, 0)


def _valid() -> dict[str, Any]:
    return {
        "qsl": torch.tensor([0, 1, 6, 7], dtype=I32),
        "kv": torch.tensor([9, 5, 3], dtype=I32),
        "table": torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32),
        "bs": 4,
    }


def _tensor(values: list[Any], dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


BROKEN = {
    "negative first offset": {"qsl": _tensor([-1, 1, 6, 7])},
    "decreasing offsets": {"qsl": _tensor([0, 6, 1, 7])},
    "offsets past int32": {"qsl": _tensor([0, 1, 2, 2**31 + 2], I64)},
    "seq_lens shorter than the query": {"kv": _tensor([9, 4, 3])},
    "seq_lens past int32": {"kv": _tensor([9, 2**31, 3], I64), "bs": 2**31},
    "a seq_lens too few": {"kv": _tensor([9, 5])},
    "a seq_lens too many": {"kv": _tensor([9, 5, 3, 1])},
    "a table too narrow": {"table": _tensor([[3, 5], [1, 2], [4, 0]])},
    "a table too short": {"table": _tensor([[3, 5, 8], [1, 2, 0]])},
    "a negative block id": {"table": _tensor([[3, 5, 8], [1, -2, 0], [4, 0, 0]])},
    "a block id of 2**30": {"table": _tensor([[3, 5, 8], [1, 2**30, 0], [4, 0, 0]], I64)},
    "block_size 0": {"bs": 0},
    "no offsets": {"qsl": _tensor([])},
    "offsets 2-D": {"qsl": _tensor([[0, 1, 6, 7]])},
    "a 1-D table": {"table": _tensor([3, 5, 8])},
    "int16 offsets": {"qsl": _tensor([0, 1, 6, 7], torch.int16)},
    "uint8 table": {"table": _tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], torch.uint8)},
    "float seq_lens": {"kv": _tensor([9, 5, 3], torch.float32)},
    "meta offsets": {"qsl": _tensor([0, 1, 6, 7]).to("meta")},
    "not a tensor": {"kv": [9, 5, 3]},
}


@pytest.mark.parametrize("broken", list(BROKEN), ids=list(BROKEN))
def test_a_broken_rule_is_refused_with_none(broken: str) -> None:
    args = _valid()
    args.update(BROKEN[broken])
    assert _index()(args["qsl"], args["kv"], args["table"], args["bs"]) is None


def test_ids_just_inside_are_taken() -> None:
    table = _tensor([[3, 5, 2**30 - 1], [1, 2, 0], [4, 0, 0]], I64)
    args = _valid()
    found = _index()(args["qsl"], args["kv"], table, 4)
    assert found is not None and int(found.kv_indices[2]) == 2**31 - 2


def test_a_short_buffer_is_told_its_size_and_a_null_one_refused() -> None:
    assert not isinstance(LIB, str)
    qsl, kv, table = _tensor([0, 1, 2]), _tensor([9, 5]), _tensor([[3, 5, 8], [1, 2, 0]])

    def call(out: torch.Tensor | None, capacity: int) -> tuple[int, NaStepInfo]:
        info = NaStepInfo()
        raw = STEP_ARGS.pack(
            qsl.data_ptr(), kv.data_ptr(), table.data_ptr(), 0 if out is None else out.data_ptr(),
            3, 1, 2, 1, 2, 3, 3, 1, 4, capacity, 0, 0, 0, 1,
        )  # fmt: skip
        return LIB.cdll.na_step_index(raw, ctypes.byref(info)), info

    out = torch.full((20,), -7, dtype=I32)
    rc, info = call(out, 3)  # not even the offsets fit: nothing written
    assert rc == NaStatus.SHORT_BUFFER and info.out_used == 3 * 2 + 2 + 5
    assert out.tolist() == [-7] * 20
    rc, info = call(out, int(info.out_used) - 1)
    assert rc == NaStatus.SHORT_BUFFER
    assert int((out[8:] == -7).sum()) == 12  # no block written past what it was told
    rc, info = call(out, int(info.out_used))
    assert rc == NaStatus.OK and out[:13].tolist() == [0, 1, 2, 0, 3, 5, 9, 5, 6, 10, 16, 2, 4]
    assert out[13:].tolist() == [-7] * 7
    assert call(None, 13)[0] == NaStatus.BAD_ARGS
    assert LIB.cdll.na_step_index(None, ctypes.byref(NaStepInfo())) == NaStatus.BAD_ARGS


def test_the_packed_bytes_are_the_ctypes_struct() -> None:
    """STEP_ARGS packs the fields of NaStepArgs in order, at the library's layout."""
    assert_packs_as_struct(STEP_ARGS, NaStepArgs)
    assert not isinstance(LIB, str)
    for struct in (NaStepArgs, NaStepInfo):
        assert LIB.cdll.na_struct_size(struct.__name__.encode()) == ctypes.sizeof(struct)
