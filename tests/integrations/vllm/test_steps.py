"""The vLLM step mapping (``step_parts``) on hand-made steps: torch only, no vLLM.

Each wrong input is refused with ``InvalidBatchError`` naming the field (and the request),
never a raw IndexError and never a request silently left out; right inputs split as before.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch.backends.native.step_index import step_indexer  # noqa: E402
from attn_dispatch.integrations.vllm import _steps  # noqa: E402
from attn_dispatch.integrations.vllm._steps import step_parts  # noqa: E402

I32 = torch.int32


@pytest.fixture(autouse=True, params=["lists", "tensors", "native"])
def path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on each way a step is built: small steps as Python ints (one host
    read), large ones with tensor ops (``_LIST_CELLS`` 0 sends every step there), and steps
    of one query length by the native library's one call (``step_indexer``; the others then
    as Python ints)."""
    if request.param == "native":
        index = step_indexer()
        if index is None:
            pytest.skip("the native library is not built")
        monkeypatch.setattr(_steps, "_NATIVE_INDEX", [index])
    else:
        monkeypatch.setattr(_steps, "_NATIVE_INDEX", [None])
    if request.param == "tensors":
        monkeypatch.setattr(_steps, "_LIST_CELLS", 0)
    return str(request.param)


def _step(**over: Any) -> tuple[Any, ...]:
    """A valid step of three requests (decode, prompt, decode; block size 4), with fields
    replaced by ``over``."""
    args: dict[str, Any] = dict(
        query_start_loc=torch.tensor([0, 1, 6, 7], dtype=I32),
        seq_lens=torch.tensor([9, 5, 3], dtype=I32),
        block_table=torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32),
        block_size=4,
        num_speculative_tokens=0,
        mixed="split",
    )
    args.update(over)
    return step_parts(
        args.pop("query_start_loc"), args.pop("seq_lens"), args.pop("block_table"), **args
    )


def _refused(field: str, request: int | None, match: str, **over: Any) -> InvalidBatchError:
    with pytest.raises(InvalidBatchError, match=match) as err:
        _step(**over)
    assert err.value.field == field
    assert err.value.request == request
    assert isinstance(err.value, ValueError)
    assert f"{field}:" in str(err.value)
    return err.value


def test_valid_step_splits_every_request() -> None:
    dec, pre = _step()
    assert dec.batch.phase is Phase.DECODE and pre.batch.phase is Phase.PREFILL
    # Not consecutive: the decodes' rows are gathered (0 and 6), the prompt is one slice.
    assert dec.rows.tolist() == [0, 6] and pre.rows == slice(1, 6)
    assert dec.batch.kv_indices.tolist() == [6, 10, 16, 8]
    assert pre.batch.kv_indices.tolist() == [2, 4]
    assert dec.batch.kv_lens.tolist() == [9, 3] and pre.batch.q_lens() == [5]


def test_block_table_narrower_than_a_sequence() -> None:
    # Request 0 has 9 tokens: 3 blocks of 4; a 2-wide table cannot hold it (was IndexError).
    err = _refused(
        "block_table", 0, "needs 3", block_table=torch.tensor([[3, 5], [1, 2], [4, 0]], dtype=I32)
    )
    assert "2 block(s) per row" in str(err)
    # Fewer rows than requests.
    _refused("block_table", None, r"a row per request", block_table=torch.tensor([[3, 5, 8]]))
    _refused("block_table", None, "shape", block_table=torch.tensor([3, 5, 8], dtype=I32))


def test_decreasing_query_start_loc_is_refused_not_dropped() -> None:
    # 0, 6, 1, 7: request 1 would have -5 query tokens and was silently left out.
    err = _refused(
        "query_start_loc", 1, "decreases from 6 to 1", query_start_loc=torch.tensor([0, 6, 1, 7])
    )
    assert "negative query length" in str(err)
    _refused("query_start_loc", None, "starts at -1", query_start_loc=torch.tensor([-1, 1, 6, 7]))
    _refused("query_start_loc", None, "none", query_start_loc=torch.tensor([], dtype=I32))


def test_negative_and_short_seq_lens() -> None:
    _refused("seq_lens", 2, "negative length -1", seq_lens=torch.tensor([9, 5, -1]))
    # The prompt has 5 query tokens; seq_lens counts them too, so 4 is impossible.
    _refused(
        "seq_lens", 1, "fewer than the request's 5 query tokens", seq_lens=torch.tensor([9, 4, 3])
    )
    _refused("seq_lens", None, "expected 3 entries, got 2", seq_lens=torch.tensor([9, 5]))


def test_block_ids_out_of_range() -> None:
    table = torch.tensor([[3, 5, 8], [1, -1, 0], [4, 0, 0]], dtype=I32)
    _refused("block_table", 1, r"\[1, -1\]", block_table=table)
    huge = torch.tensor([[3, 5, 2**31], [1, 2, 0], [4, 0, 0]], dtype=torch.int64)
    _refused("block_table", 0, "block ids must be in", block_table=huge)
    # Entries past what a request reads are vLLM's padding and are not looked at.
    pad = torch.tensor([[3, 5, 8, -1], [1, 2, -1, -1], [4, -1, -1, -1]], dtype=I32)
    assert [p.batch.kv_indices.tolist() for p in _step(block_table=pad)] == [[6, 10, 16, 8], [2, 4]]


def test_wrong_types_and_scalars() -> None:
    _refused("seq_lens", None, "integer tensor", seq_lens=torch.tensor([9.0, 5.0, 3.0]))
    _refused("query_start_loc", None, "torch.Tensor", query_start_loc=[0, 1, 6, 7])
    _refused("query_start_loc", None, "one dimension", query_start_loc=torch.zeros(2, 2, dtype=I32))
    _refused("block_table", None, "integer tensor", block_table=torch.zeros(3, 3, dtype=torch.bool))
    _refused("block_size", None, "int >= 1", block_size=0)
    _refused("block_size", None, "int >= 1", block_size=True)
    _refused("num_speculative_tokens", None, "int >= 0", num_speculative_tokens=-1)
    _refused("mixed", None, "'split', 'extend'", mixed="both")
    _refused("draft", None, "bool", draft=1)


def test_requests_without_query_tokens_are_left_out_and_padding_is_free() -> None:
    # vLLM pads a step with requests of no query token; their seq_lens and rows do not matter.
    (dec,) = step_parts(
        torch.tensor([0, 1, 1, 1], dtype=I32),
        torch.tensor([9, 0, 0], dtype=I32),
        torch.tensor([[3, 5, 8], [-1, -1, -1], [-1, -1, -1]], dtype=I32),
        block_size=4,
        num_speculative_tokens=0,
        mixed="split",
    )
    assert dec.batch.phase is Phase.DECODE and dec.rows == slice(0, 1)
    assert (
        step_parts(
            torch.tensor([0], dtype=I32),
            torch.tensor([], dtype=I32),
            torch.zeros(0, 3, dtype=I32),
            block_size=4,
            num_speculative_tokens=0,
            mixed="split",
        )
        == ()
    )


@pytest.mark.parametrize("seed", range(3))
def test_random_valid_steps_cover_every_query_row_once(seed: int) -> None:
    """Whatever the mix, every query row of every request lands in exactly one part, and each
    part's pages are its requests' own blocks."""
    g = torch.Generator().manual_seed(seed)
    n = 12
    q = torch.randint(0, 7, (n,), generator=g)
    cached = torch.randint(0, 30, (n,), generator=g)
    kv = q + cached
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)])
    bs = 8
    table = torch.randperm(n * 8, generator=g).view(n, 8).to(I32)
    for mixed in ("split", "extend"):
        for k in (0, 3):
            parts = step_parts(
                qsl.to(I32), kv.to(I32), table, block_size=bs, num_speculative_tokens=k, mixed=mixed
            )
            rows = (
                torch.cat(
                    [
                        torch.arange(60)[p.rows] if isinstance(p.rows, slice) else p.rows
                        for p in parts
                    ]
                )
                if parts
                else torch.zeros(0, dtype=torch.int64)
            )
            assert sorted(rows.tolist()) == list(range(int(qsl[-1])))
            pages = sorted(x for p in parts for x in p.batch.kv_indices.tolist())
            want = sorted(
                2 * int(table[i, b])
                for i in range(n)
                if q[i] > 0
                for b in range(-(-int(kv[i]) // bs))
            )
            assert pages == want


@pytest.mark.parametrize("seed", range(4))
def test_both_paths_build_the_same_batches(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python-int path (small steps) and the tensor path (large ones) give equal parts,
    and refuse the same bad block id with the same request named."""
    g = torch.Generator().manual_seed(100 + seed)
    n = 9
    q = torch.randint(0, 5, (n,), generator=g)
    kv = q + torch.randint(0, 40, (n,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)]).to(I32)
    table = torch.randperm(n * 6, generator=g).view(n, 6).to(I32)

    def build() -> list[tuple[Any, ...]]:
        parts = step_parts(
            qsl, kv.to(I32), table, block_size=8, num_speculative_tokens=2, mixed="split"
        )
        return [
            (
                p.batch.phase,
                p.batch.qo_indptr.tolist(),
                p.batch.kv_indptr.tolist(),
                p.batch.kv_indices.tolist(),
                p.batch.kv_lens.tolist(),
                p.rows if isinstance(p.rows, slice) else p.rows.tolist(),
            )
            for p in parts
        ]

    monkeypatch.setattr(_steps, "_LIST_CELLS", 4096)
    small = build()
    monkeypatch.setattr(_steps, "_LIST_CELLS", 0)
    assert build() == small and small
    # A negative block id inside what the last reading request reads: both paths name it.
    last = max(i for i in range(n) if q[i] > 0)
    table[last, 0] = -3
    fields = []
    for cells in (4096, 0):
        monkeypatch.setattr(_steps, "_LIST_CELLS", cells)
        with pytest.raises(InvalidBatchError, match="block ids must be in") as err:
            build()
        fields.append((err.value.field, err.value.request))
    assert fields == [("block_table", last)] * 2


INTEGER_DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
]


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_one_dtype_rule_for_every_index_field(dtype: torch.dtype) -> None:
    """Every integer dtype is read as its values, on both paths (the tensor path refused 8- and
    16-bit block tables with "block ids must be in [0, 2**30)" while listing ids inside it, and
    raised torch's own NotImplementedError for unsigned ones)."""
    # Block 127 (the largest id every dtype here holds) is page 254: doubled in the table's
    # own dtype, an int8 id would wrap.
    table = torch.tensor([[3, 5, 127], [1, 2, 0], [4, 0, 0]]).to(dtype)
    dec, pre = _step(
        query_start_loc=torch.tensor([0, 1, 6, 7]).to(dtype),
        seq_lens=torch.tensor([9, 5, 3]).to(dtype),
        block_table=table,
    )
    assert dec.batch.kv_indices.tolist() == [6, 10, 254, 8]
    assert pre.batch.kv_indices.tolist() == [2, 4]
    assert dec.batch.kv_indices.dtype == torch.int32


def test_ids_past_int64_are_refused_with_their_values() -> None:
    # A uint64 id of 2**63 + 5 is out of range on both paths, named as it is (not wrapped).
    table = torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=torch.uint64)
    table[0, 2] = torch.tensor(-(2**63) + 5, dtype=torch.int64).view(torch.uint64)
    err = _refused("block_table", 0, "block ids must be in", block_table=table)
    assert str(2**63 + 5) in str(err)


@pytest.mark.parametrize("field", ["query_start_loc", "seq_lens", "block_table"])
def test_meta_tensors_are_refused_with_our_error(field: str) -> None:
    # A meta tensor has no values: was torch's raw NotImplementedError (or RuntimeError).
    valid = {
        "query_start_loc": torch.tensor([0, 1, 6, 7], dtype=I32),
        "seq_lens": torch.tensor([9, 5, 3], dtype=I32),
        "block_table": torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32),
    }
    err = _refused(field, None, "expected a CPU tensor", **{field: valid[field].to("meta")})
    assert "'meta'" in str(err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_are_refused_with_our_error() -> None:
    table = torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32, device="cuda")
    _refused("block_table", None, "expected a CPU tensor", block_table=table)


_DERIVED = (
    "phase",
    "page_size",
    "num_pages",
    "num_requests",
    "num_tokens",
    "max_q_len",
    "max_kv_len",
)
_TENSORS = (
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_lens",
    "qo_indptr_host",
    "kv_indptr_host",
    "kv_lens_host",
)


@pytest.mark.parametrize("seed", range(4))
def test_built_batches_are_what_the_checked_constructor_makes(seed: int) -> None:
    """The small-step path builds its batches without AttnBatch's second check
    (``AttnBatch._of_checked``): each equals, field by field, the batch the checking
    constructor makes from the same index tensors, which accepts it."""
    from attn_dispatch import AttnBatch

    g = torch.Generator().manual_seed(200 + seed)
    n = 10
    q = torch.randint(0, 6, (n,), generator=g)
    q[0] = 1  # a request with a query token, whatever the draw
    kv = q + torch.randint(0, 30, (n,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)]).to(I32)
    table = torch.randperm(n * 6, generator=g).view(n, 6).to(I32)
    for mixed in ("split", "extend"):
        for k in (0, 3):
            parts = step_parts(
                qsl, kv.to(I32), table, block_size=8, num_speculative_tokens=k, mixed=mixed
            )
            assert parts
            for p in parts:
                b = p.batch
                checked = AttnBatch(
                    phase=b.phase,
                    qo_indptr=b.qo_indptr.clone(),
                    kv_indptr=b.kv_indptr.clone(),
                    kv_indices=b.kv_indices.clone(),
                    kv_lens=b.kv_lens.clone(),
                    page_size=b.page_size,
                )
                for name in _DERIVED:
                    assert getattr(b, name) == getattr(checked, name), name
                for name in _TENSORS:
                    got, want = getattr(b, name), getattr(checked, name)
                    assert got.dtype == want.dtype == I32, name
                    assert got.tolist() == want.tolist(), name
                assert b.custom_mask is None and b.mask_indptr is None


@pytest.mark.parametrize("mixed", ["split", "extend"])
def test_a_decode_step_is_one_part_of_every_row(mixed: str) -> None:
    """A step whose requests all decode is one DECODE part over every query row (q and
    vLLM's buffer are then used as they are); a step with one prompt among them is not."""
    (part,) = step_parts(
        torch.arange(5, dtype=I32),
        torch.tensor([9, 1, 4, 12], dtype=I32),
        torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0], [6, 7, 9]], dtype=I32),
        block_size=4,
        num_speculative_tokens=0,
        mixed=mixed,
    )
    assert part.batch.phase is Phase.DECODE and part.rows == slice(0, 4)
    assert part.batch.kv_indices.tolist() == [6, 10, 16, 2, 8, 12, 14, 18]
    parts = step_parts(
        torch.tensor([0, 1, 3, 4], dtype=I32),
        torch.tensor([9, 2, 4], dtype=I32),
        torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32),
        block_size=4,
        num_speculative_tokens=0,
        mixed=mixed,
    )
    want = [Phase.PREFILL] if mixed == "extend" else [Phase.DECODE, Phase.PREFILL]
    assert [p.batch.phase for p in parts] == want


def _built(parts: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Everything a step's parts hold, as plain values (every derived count and index tensor
    of each batch, as ``test_built_batches_are_what_the_checked_constructor_makes`` reads)."""
    return [
        (
            p.index,
            *(getattr(p.batch, name) for name in _DERIVED),
            *((getattr(p.batch, name).dtype, getattr(p.batch, name).tolist()) for name in _TENSORS),
            p.batch.custom_mask,
            p.rows if isinstance(p.rows, slice) else p.rows.tolist(),
        )
        for p in parts
    ]


def _native_or_skip() -> Any:
    index = step_indexer()
    if index is None:
        pytest.skip("the native library is not built")
    return index


@pytest.mark.parametrize("seed", range(8))
def test_native_index_builds_what_python_builds(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of one query length (decode, verify, prefill; int32 and int64; strided views; a
    first offset past 0; one request with nothing cached): the native call's parts equal the
    Python path's, and it builds exactly the steps whose requests share one phase."""
    index = _native_or_skip()
    g = torch.Generator().manual_seed(300 + seed)
    n = int(torch.randint(1, 10, (1,), generator=g))
    q = [1, 2, 4, 5, 7, 1, 4, 3][seed]
    cached = torch.randint(0, 40, (n,), generator=g)
    if seed % 3 == 2:
        cached[n // 2] = 0  # a request all new: a prompt among verifies
    kv = (q + cached).to(I32 if seed % 2 else torch.int64)
    first = int(torch.randint(0, 5, (1,), generator=g))
    qsl = (first + q * torch.arange(n + 1)).to(I32)
    table = torch.randperm((n + 2) * 16, generator=g).view(n + 2, 16)
    table = (table[:, ::2] if seed % 4 == 3 else table[:, :8]).to(I32 if seed < 4 else torch.int64)
    calls = []
    checked = _steps._checked

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return checked(*args, **kwargs)

    monkeypatch.setattr(_steps, "_checked", spy)
    for mixed in ("split", "extend"):
        for k in (0, 3):
            for draft in (False, True):
                built = []
                for found in (None, index):
                    monkeypatch.setattr(_steps, "_NATIVE_INDEX", [found])
                    calls.clear()
                    parts = step_parts(
                        qsl, kv, table, block_size=8, num_speculative_tokens=k, mixed=mixed,
                        draft=draft,
                    )  # fmt: skip
                    built.append(_built(parts))
                assert built[1] == built[0]
                phases = {_steps.request_phase(q, int(x), k, draft=draft) for x in kv.tolist()}
                # The native call built the step exactly when it is one phase.
                assert calls == ([] if len(phases) == 1 else [1]), (phases, calls)


NATIVE_BROKEN: dict[str, dict[str, Any]] = {
    "decreasing offsets": {"query_start_loc": torch.tensor([0, 1, 0, 3], dtype=I32)},
    "negative first offset": {"query_start_loc": torch.tensor([-1, 0, 1, 2], dtype=I32)},
    "seq_lens shorter than the query": {"seq_lens": torch.tensor([9, 0, 3], dtype=I32)},
    "a seq_lens too few": {"seq_lens": torch.tensor([9, 5], dtype=I32)},
    "a table too narrow": {"block_table": torch.tensor([[3, 5], [1, 2], [4, 0]], dtype=I32)},
    "a table too short": {"block_table": torch.tensor([[3, 5, 8], [1, 2, 0]], dtype=I32)},
    "a negative block id": {
        "block_table": torch.tensor([[3, 5, 8], [1, -2, 0], [4, 0, 0]], dtype=I32)
    },
    "a block id of 2**30": {
        "block_table": torch.tensor([[3, 5, 8], [2**30, 2, 0], [4, 0, 0]], dtype=torch.int64)
    },
    "a float seq_lens": {"seq_lens": torch.tensor([9.0, 5.0, 3.0])},
    "a meta table": {"block_table": torch.zeros(3, 3, dtype=I32, device="meta")},
    "2-D offsets": {"query_start_loc": torch.tensor([[0, 1, 2, 3]], dtype=I32)},
    "offsets as a list": {"query_start_loc": [0, 1, 2, 3]},
}


@pytest.mark.parametrize("broken", list(NATIVE_BROKEN), ids=list(NATIVE_BROKEN))
def test_native_index_refuses_what_python_refuses(
    broken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step with one rule broken: the native call refuses it, and the error is the
    Python path's, naming the same field and request with the same words."""
    index = _native_or_skip()
    args: dict[str, Any] = {
        "query_start_loc": torch.tensor([0, 1, 2, 3], dtype=I32),
        "seq_lens": torch.tensor([9, 5, 3], dtype=I32),
        "block_table": torch.tensor([[3, 5, 8], [1, 2, 0], [4, 0, 0]], dtype=I32),
    }
    args.update(NATIVE_BROKEN[broken])
    errors = []
    for found in (None, index):
        monkeypatch.setattr(_steps, "_NATIVE_INDEX", [found])
        with pytest.raises(InvalidBatchError) as err:
            step_parts(
                args["query_start_loc"], args["seq_lens"], args["block_table"], block_size=4,
                num_speculative_tokens=0, mixed="split",
            )  # fmt: skip
        errors.append((err.value.field, err.value.request, str(err.value)))
    assert errors[0] == errors[1]
