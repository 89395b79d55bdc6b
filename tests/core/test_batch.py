"""AttnBatch validation and builders: each failure names the field and the request."""

from __future__ import annotations

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import tree_mask

I32 = torch.int32


def raw(**over: object) -> AttnBatch:
    args: dict[str, object] = dict(
        phase=Phase.PREFILL,
        qo_indptr=torch.tensor([0, 2, 5], dtype=I32),
        kv_indptr=torch.tensor([0, 1, 3], dtype=I32),
        kv_indices=torch.tensor([4, 0, 2], dtype=I32),
        kv_lens=torch.tensor([3, 7], dtype=I32),
        page_size=4,
        num_pages=5,
    )
    args.update(over)
    return AttnBatch(**args)  # type: ignore[arg-type]


def test_valid_batch_derives_host_fields() -> None:
    b = raw()
    assert b.num_requests == 2 and b.num_tokens == 5
    assert b.max_q_len == 3 and b.max_kv_len == 7
    assert b.q_lens() == [2, 3]
    assert b.qo_indptr_host.device.type == "cpu"
    assert b.mask_indptr is None


@pytest.mark.parametrize(
    ("over", "field", "request_", "text"),
    [
        (dict(kv_indices=torch.tensor([4, 0, 2], dtype=torch.int64)), "kv_indices", None, "int32"),
        (dict(qo_indptr=torch.tensor([0, 3, 2], dtype=I32)), "qo_indptr", 1, "non-decreasing"),
        (dict(qo_indptr=torch.tensor([1, 2, 5], dtype=I32)), "qo_indptr", None, "start at 0"),
        (dict(kv_indptr=torch.tensor([0, 2, 1], dtype=I32)), "kv_indptr", 1, "non-decreasing"),
        (dict(kv_lens=torch.tensor([1, 7], dtype=I32)), "kv_lens", 0, "kv_len 1 < q_len 2"),
        (dict(kv_indices=torch.tensor([4, 0, 5], dtype=I32)), "kv_indices", 1, "out of range"),
        (dict(kv_indices=torch.tensor([4, -1, 2], dtype=I32)), "kv_indices", 1, "out of range"),
        (dict(kv_lens=torch.tensor([3, 9], dtype=I32)), "kv_indptr", 1, "cannot hold"),
        (dict(qo_indptr=torch.tensor([0, 2], dtype=I32)), "qo_indptr", None, r"len\(kv_lens\)"),
        (
            dict(kv_indptr=torch.tensor([0, 1, 4], dtype=I32)),
            "kv_indptr",
            None,
            r"len\(kv_indices\)",
        ),
        (dict(phase=Phase.DECODE), "qo_indptr", 0, "exactly one query"),
        (dict(phase="decode"), "phase", None, "Phase"),
        (dict(qo_indptr=[0, 2, 5]), "qo_indptr", None, "torch.Tensor"),
        (dict(qo_indptr=torch.tensor([0, 0, 5], dtype=I32)), "qo_indptr", 0, ">= 1 query"),
    ],
)
def test_validation_names_field_and_request(
    over: dict[str, object], field: str, request_: int | None, text: str
) -> None:
    with pytest.raises(InvalidBatchError, match=text) as err:
        raw(**over)
    assert err.value.field == field
    assert err.value.request == request_
    assert isinstance(err.value, ValueError)
    if request_ is not None:
        assert f"request {request_}" in str(err.value)


def test_mask_length_and_empty_rows() -> None:
    ok = torch.ones(2 * 3 + 3 * 7, dtype=torch.bool)
    b = raw(custom_mask=ok)
    assert b.mask_indptr is not None and b.mask_indptr.tolist() == [0, 6, 27]
    with pytest.raises(InvalidBatchError, match="sum") as err:
        raw(custom_mask=ok[:-1])
    assert err.value.field == "custom_mask"
    bad = ok.clone()
    bad[6 + 7 : 6 + 14] = False  # request 1, query 1 sees nothing
    with pytest.raises(InvalidBatchError, match="query 1 may attend to no key") as err:
        raw(custom_mask=bad)
    assert err.value.request == 1
    with pytest.raises(InvalidBatchError, match="bool"):
        raw(custom_mask=ok.int())


def test_build_matches_raw_and_checks_lengths() -> None:
    b = AttnBatch.build(
        Phase.PREFILL, q_lens=[2, 3], kv_lens=[3, 7], page_tables=[[4], [0, 2]], page_size=4
    )
    assert b.qo_indptr.tolist() == [0, 2, 5]
    assert b.kv_indptr.tolist() == [0, 1, 3]
    assert b.kv_indices.tolist() == [4, 0, 2]
    with pytest.raises(InvalidBatchError, match="one entry per request"):
        AttnBatch.build(
            Phase.PREFILL, q_lens=[2], kv_lens=[3, 7], page_tables=[[4], [0]], page_size=4
        )
    with pytest.raises(InvalidBatchError, match="shape") as err:
        AttnBatch.build(
            Phase.VERIFY,
            q_lens=[2],
            kv_lens=[3],
            page_tables=[[1]],
            page_size=4,
            masks=[torch.ones(3, 3, dtype=torch.bool)],
        )
    assert err.value.request == 0


def test_tree_mask_sees_prefix_ancestors_and_itself() -> None:
    m = tree_mask([-1, 0, 0, 1], prefix_len=2)
    assert m.shape == (4, 6)
    assert m[:, :2].all()
    expect = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(m[:, 2:], expect)
    assert m.any(dim=1).all()  # no fully masked row by construction
    chain = tree_mask([-1, 0, 1], prefix_len=0)
    assert torch.equal(chain, torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-2], [-1, 3, 0]])
def test_tree_mask_rejects_bad_parents(parents: list[int]) -> None:
    with pytest.raises(InvalidBatchError, match="parent") as err:
        tree_mask(parents, prefix_len=3)
    assert err.value.field == "parents"


def test_to_keeps_host_copies_on_cpu() -> None:
    b = raw().to("cpu")
    assert b.kv_lens_host.device.type == "cpu"
    assert b.num_tokens == 5


# ---------------------------------------------------------------- the shared validator


def test_snapshot_owns_checked_copies() -> None:
    from attn_dispatch._snapshot import BatchSnapshot

    b = raw()
    snap = BatchSnapshot.of(b, 4)
    assert (snap.num_requests, snap.num_tokens, snap.max_q_len, snap.max_kv_len) == (2, 5, 3, 7)
    assert snap.max_page == 4 and snap.page_size == 4
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_lens"):
        mine, theirs = getattr(snap, name), getattr(b, name)
        assert mine.is_contiguous() and mine.data_ptr() != theirs.data_ptr()
    b.kv_indices[1] = -1
    assert snap.kv_indices.tolist() == [4, 0, 2]  # the edit never reaches the snapshot
    with pytest.raises(InvalidBatchError, match="negative") as err:
        BatchSnapshot.of(b, 4)
    assert err.value.field == "kv_indices" and err.value.request == 1


def test_snapshot_checks_at_the_bound_page_size() -> None:
    from attn_dispatch._snapshot import BatchSnapshot

    b = raw(page_size=None)
    assert BatchSnapshot.of(b, 4).max_kv_len == 7
    with pytest.raises(InvalidBatchError, match="cannot hold") as err:
        BatchSnapshot.of(b, 2)  # request 0: 1 page of 2 tokens < kv_len 3
    assert err.value.field == "kv_indptr" and err.value.request == 0
    with pytest.raises(InvalidBatchError, match="page_size") as err:
        BatchSnapshot.of(raw(), 8)
    assert err.value.field == "page_size"
    assert BatchSnapshot.of(b, None).page_size is None  # a caller that reads no pages


def test_snapshot_large_batch_takes_the_vector_path() -> None:
    from attn_dispatch import _contract
    from attn_dispatch._snapshot import BatchSnapshot

    n = _contract._LIST_MAX + 5
    b = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * n, kv_lens=[3] * n, page_tables=[[i] for i in range(n)],
        page_size=4,
    )  # fmt: skip
    snap = BatchSnapshot.of(b, 4)
    assert (snap.num_tokens, snap.max_kv_len, snap.max_page) == (n, 3, n - 1)
    b.kv_lens[n - 2] = 9
    with pytest.raises(InvalidBatchError, match="cannot hold") as err:
        BatchSnapshot.of(b, 4)
    assert err.value.request == n - 2


def test_tensor_checks_name_the_field() -> None:
    from attn_dispatch import AttnConfig
    from attn_dispatch._snapshot import BatchSnapshot
    from attn_dispatch._tensor_checks import TensorChecks

    cfg = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=4)
    checks = TensorChecks.of(cfg, backend="test", layout="contiguous")
    snap = BatchSnapshot.of(raw(), 4)
    q, k, v = torch.zeros(5, 4, 16), torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16)
    assert checks.check(snap, q, k, v) == 5
    bad = [
        ((q[:4], k, v), "q", "4 rows"),
        ((q.double(), k, v), "q", "dtype"),
        ((q, k[:4], v[:4]), "kv_indices", "out of range"),
        ((q, k, v[:3]), "v_cache", "as many pages"),
        ((q, k, None), "v_cache", "needs a v_cache"),
        ((q, k[..., :8], v), "k_cache", "shape"),
        ((q.transpose(0, 1).contiguous().transpose(0, 1), k, v), "q", "contiguous"),
        (([0], k, v), "q", "torch.Tensor"),
    ]
    for args, field, text in bad:
        with pytest.raises(InvalidBatchError, match=text) as err:
            checks.check(snap, *args)
        assert err.value.field == field


def test_plan_check_is_identity() -> None:
    import copy
    import dataclasses

    from attn_dispatch._protocol import PlanBase
    from attn_dispatch._protocol import check_plan
    from attn_dispatch._protocol import issue_plan

    @dataclasses.dataclass(frozen=True, slots=True, eq=False)
    class Plan(PlanBase):
        owner: object
        rows: int

    me, other = object(), object()
    plan = issue_plan(me, Plan(owner=me, rows=3))
    check_plan(plan, me, "test")
    forged = [dataclasses.replace(plan), dataclasses.replace(plan, rows=1), Plan(me, 3), None]
    for bad in [*forged, issue_plan(other, Plan(owner=me, rows=3))]:
        with pytest.raises(InvalidBatchError, match="not by the backend") as err:
            check_plan(bad, me, "test")
        assert err.value.field == "plan"
    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(InvalidBatchError, match="cannot be copied") as err:
            copier(plan)
        assert err.value.field == "plan"


def test_refill_checks_everything_before_writing() -> None:
    from attn_dispatch._snapshot import BatchSnapshot
    from attn_dispatch._snapshot import refill

    def decode(lens: list[int], tables: list[list[int]]) -> AttnBatch:
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1] * len(lens), kv_lens=lens, page_tables=tables, page_size=4
        )

    captured = BatchSnapshot.of(decode([3, 5], [[1, 1], [2, 3]]), 4)
    ptrs = [captured.kv_indices.data_ptr(), captured.kv_lens.data_ptr()]
    refill(captured, BatchSnapshot.of(decode([4, 6], [[7], [2, 3]]), 4))
    assert captured.kv_lens.tolist() == [4, 6] and captured.max_page == 7
    assert captured.kv_indices[:3].tolist() == [7, 2, 3]  # fewer entries fit the capacity
    assert [captured.kv_indices.data_ptr(), captured.kv_lens.data_ptr()] == ptrs
    before = captured.kv_indices.clone()
    with pytest.raises(InvalidBatchError, match="do not fit") as err:
        refill(captured, BatchSnapshot.of(decode([9, 9], [[1, 2, 3], [4, 5, 6]]), 4))
    assert err.value.field == "kv_indices"
    assert torch.equal(captured.kv_indices, before) and captured.kv_lens.tolist() == [4, 6]
    with pytest.raises(InvalidBatchError, match="requests"):
        refill(captured, BatchSnapshot.of(decode([1], [[0]]), 4))
