"""Cascade (shared-prefix) attention in the native backend, and its log-sum-exp output.

The planner finds requests whose page tables start with the same whole pages and reads those
pages once for all of them, merging with each request's own keys by log-sum-exp. These tests
check that it runs exactly when it should (shared prefixes, partly shared tables, not for
shared pages at another position, not with a window or a chunk, not for long prefill tiles)
and that its outputs and lse equal the plain plan's and the float64 oracle's, for random
tables (hypothesis), masks, sinks, caps, FP8 caches and MLA.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import InvalidSpecError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from tests import oracle  # noqa: E402
from tests.strategies import CascadeCase  # noqa: E402
from tests.strategies import cascade_cases  # noqa: E402

LIB = load()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")

if not isinstance(LIB, str):
    from attn_dispatch.backends.native.backend import NativeBackend

D, DV_MLA = 32, 16


def tensors(case: CascadeCase) -> dict[str, Any]:
    """The batch, config, q and caches of a case (seeded), and the call's extras."""
    gen = torch.Generator().manual_seed(case.seed)
    ps, hq, hkv = case.page_size, case.num_q_heads, case.num_kv_heads
    mla = case.kind == "mla"
    dv = DV_MLA if mla else D
    cfg = AttnConfig(
        case.kind, hq, hkv, D, dv, dtype="float32", page_size=ps,
        kv_dtype=case.kv_dtype, sinks=case.sinks, logit_cap=case.logit_cap,
    )  # fmt: skip
    masks = None
    phase = Phase.VERIFY if any(q > 1 for q in case.q_lens) or case.tree else Phase.DECODE
    if case.tree:
        masks = []
        for q, k in zip(case.q_lens, case.kv_lens, strict=True):
            m = torch.ones(q, k, dtype=torch.bool)
            m[:, k - q :] = torch.rand(q, q, generator=gen) < 0.6
            m[:, k - q :] |= torch.eye(q, dtype=torch.bool)
            m[:, k - q :] &= torch.ones(q, q, dtype=torch.bool).tril()
            masks.append(m)
    batch = AttnBatch.build(
        phase, q_lens=list(case.q_lens), kv_lens=list(case.kv_lens),
        page_tables=[list(t) for t in case.tables], page_size=ps, num_pages=case.num_pages,
        masks=masks,
    )  # fmt: skip
    shape = (case.num_pages, ps, D) if mla else (case.num_pages, ps, hkv, D)
    k = torch.randn(shape, generator=gen)
    v = None if mla else torch.randn(case.num_pages, ps, hkv, dv, generator=gen)
    extras: dict[str, Any] = {}
    if case.kv_dtype is not None:
        fp8 = getattr(torch, case.kv_dtype)
        k = k.to(fp8)
        v = None if v is None else v.to(fp8)
        extras["k_scale"] = 0.5
        if not mla:
            extras["v_scale"] = 2.0
    if case.sinks:
        extras["sinks"] = torch.randn(hq, generator=gen)
    q = torch.randn(sum(case.q_lens), hq, D, generator=gen)
    return {"cfg": cfg, "batch": batch, "q": q, "k": k, "v": v, "masks": masks, "extras": extras}


def reference(case: CascadeCase, t: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle (tests/oracle.py): out and lse (natural log, sink included)."""
    extras = t["extras"]
    return oracle.reference_state(
        t["q"], t["k"], t["v"], q_lens=case.q_lens, kv_lens=case.kv_lens,
        page_tables=case.tables, masks=t["masks"], sm_scale=D**-0.5,
        v_head_dim=t["cfg"].v_head_dim, logit_cap=t["cfg"].logit_cap, sinks=extras.get("sinks"),
        k_scale=extras.get("k_scale", 1.0), v_scale=extras.get("v_scale", 1.0),
    )  # fmt: skip


def run(case: CascadeCase, t: dict[str, Any], **options: Any) -> tuple[Any, Any, Any]:
    be = NativeBackend(t["cfg"], num_threads=2, **options)
    plan = be.plan(t["batch"])
    out, lse = be.handler(t["batch"].phase)(
        t["q"], t["k"], t["v"], plan, D**-0.5, return_lse=True, **t["extras"]
    )
    return plan, out, lse


def expected_groups(case: CascadeCase, masks: list[Any] | None = None) -> int:
    """How many cascade groups the planner must form (its rules, restated from scratch)."""
    ps = case.page_size
    group_heads = case.num_q_heads // case.num_kv_heads
    by_first: dict[int, list[int]] = {}
    usable = {}
    for i, (ql, kl, table) in enumerate(zip(case.q_lens, case.kv_lens, case.tables, strict=True)):
        if group_heads * ql > 16:
            continue
        # Keys every query sees from the first: causal, or the run of allowed keys every row
        # of the tree mask starts with.
        seen = kl - ql + 1
        if masks is not None:
            hidden = ~masks[i]
            firsts = [int(row.nonzero()[0]) if bool(row.any()) else kl for row in hidden]
            seen = min(firsts)
        usable[i] = min(len(table), seen // ps)
        if usable[i] > 0:
            by_first.setdefault(table[0], []).append(i)
    groups = 0
    for members in by_first.values():
        if len(members) < 2:
            continue
        lead = members[0]
        lcps = []
        for i in members:
            n, most = 0, min(usable[i], usable[lead])
            while n < most and case.tables[i][n] == case.tables[lead][n]:
                n += 1
            lcps.append(n)
        lcps.sort(reverse=True)
        best, best_n = 0, 0
        for k in range(1, len(lcps)):
            if lcps[k] * ps < 64:  # the floor: shorter shares are never chosen
                break
            if k * lcps[k] > best:
                best, best_n = k * lcps[k], k + 1
        if best_n >= 2 and lcps[best_n - 1] * ps >= 64:
            groups += 1
    return groups


def tolerance(case: CascadeCase) -> float:
    return 2e-2 if case.kv_dtype else 2e-4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cascade_cases())
def test_cascade_equals_plain_plan_and_reference(case: CascadeCase) -> None:
    t = tensors(case)
    plan_on, out_on, lse_on = run(case, t)
    plan_off, out_off, lse_off = run(case, t, cascade=False)
    assert plan_off.cascade_groups == 0
    assert plan_on.cascade_groups == expected_groups(case, t["masks"])
    ref_out, ref_lse = reference(case, t)
    tol = tolerance(case)
    torch.testing.assert_close(out_on.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_on.double(), ref_lse, atol=tol, rtol=tol)
    # Same kernels, other grouping of the keys: equal to float32 rounding.
    torch.testing.assert_close(out_on, out_off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_on, lse_off, atol=1e-5, rtol=1e-5)


def case_of(tables: list[list[int]], kv_lens: list[int], **kw: Any) -> CascadeCase:
    q_lens = kw.pop("q_lens", [1] * len(tables))
    num_pages = max(p for t in tables for p in t) + 1
    return CascadeCase(
        page_size=kw.pop("page_size", 16), q_lens=tuple(q_lens), kv_lens=tuple(kv_lens),
        tables=tuple(tuple(t) for t in tables), num_pages=num_pages, tree=kw.pop("tree", False),
        **kw,
    )  # fmt: skip


PREFIX = [0, 1, 2, 3, 4]  # 80 keys at page 16: above the 64-key floor


@pytest.mark.parametrize(
    ("name", "tables", "kv_lens", "groups", "requests"),
    [
        ("all share", [[*PREFIX, 10 + i] for i in range(4)], [90] * 4, 1, 4),
        ("own part empty", [PREFIX, [*PREFIX, 10], PREFIX], [80, 85, 80], 1, 3),
        # The share that saves most reads: 4 pages for all three (8) over 5 pages for two (5).
        ("partly shared", [[*PREFIX, 10], [*PREFIX[:4], 11, 12], [*PREFIX, 13]], [90] * 3, 1, 3),
        # ... and 5 pages for two (5) over 1 page for three (2): the third runs on its own.
        ("partly shared, one left out", [[*PREFIX, 10], [0, 20, 21, 22, 23, 24], [*PREFIX, 13]],
         [90] * 3, 1, 2),
        ("not a prefix", [[*PREFIX, 10], [11, *PREFIX], [12, *PREFIX]], [90] * 3, 0, 0),
        ("below the key floor", [[0, 1, 2, 10], [0, 1, 2, 11]], [60, 60], 0, 0),
        # Four share 3 pages (48 keys, below the floor), two of them 5: those two form a group.
        ("the floor before the savings", [[*PREFIX, 10], [*PREFIX, 11], [0, 1, 2, 12],
                                          [0, 1, 2, 13]], [90, 90, 60, 60], 1, 2),
        ("two groups", [[*PREFIX, 10], [*PREFIX, 11], [20, 21, 22, 23, 24, 12],
                        [20, 21, 22, 23, 24, 13]], [90] * 4, 2, 4),
        ("last shared page partly read", [PREFIX, PREFIX], [75, 78], 1, 2),
    ],
)  # fmt: skip
def test_cascade_runs_exactly_where_pages_are_shared(
    name: str, tables: list[list[int]], kv_lens: list[int], groups: int, requests: int
) -> None:
    case = case_of(tables, kv_lens)
    t = tensors(case)
    plan, out, lse = run(case, t)
    assert (plan.cascade_groups, plan.cascade_requests) == (groups, requests), name
    note = plan.dispatch_note
    assert (note is not None) == (groups > 0)
    if groups:
        assert f"{requests} requests" in note
    ref_out, ref_lse = reference(case, t)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-4, rtol=2e-4)


def test_last_shared_page_partly_read_is_not_shared() -> None:
    # kv_len 75 covers 4 whole pages and part of the fifth: only whole pages every query
    # reads are shared (64 keys).
    case = case_of([PREFIX, PREFIX], [75, 78])
    plan, _, _ = run(case, tensors(case))
    assert plan.cascade_keys == 64


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"window_left": 40}, "window"),
        ({"attention_chunk_size": 32}, "chunk"),
    ],
)
def test_no_cascade_with_a_window_or_chunk(changes: dict[str, Any], why: str) -> None:
    cfg = AttnConfig("mha", 4, 2, D, dtype="float32", page_size=16, **changes)
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[90, 90],
        page_tables=[[*PREFIX, 10], [*PREFIX, 11]], page_size=16, num_pages=12,
    )  # fmt: skip
    assert NativeBackend(cfg).plan(batch).cascade_groups == 0, why


def test_no_cascade_for_long_prefill_tiles() -> None:
    # Eight queries x 4 heads fill a tile's rows: each key is already read for 32 rows.
    cfg = AttnConfig("mha", 8, 2, D, dtype="float32", page_size=16)
    batch = AttnBatch.build(
        Phase.PREFILL, q_lens=[8, 8], kv_lens=[96, 96],
        page_tables=[[*PREFIX, 10], [*PREFIX, 11]], page_size=16, num_pages=12,
    )  # fmt: skip
    assert NativeBackend(cfg).plan(batch).cascade_groups == 0


def test_tree_mask_hiding_a_shared_key_keeps_that_request_private() -> None:
    tables = [[*PREFIX, 10], [*PREFIX, 11], [*PREFIX, 12]]
    case = case_of(tables, [90] * 3, q_lens=[2, 2, 2], tree=True)
    t = tensors(case)
    t["masks"][1][1, 5] = False  # request 1's second draft token does not see shared key 5
    t["batch"] = AttnBatch.build(
        Phase.VERIFY, q_lens=[2, 2, 2], kv_lens=[90] * 3, page_tables=tables, page_size=16,
        num_pages=case.num_pages, masks=t["masks"],
    )  # fmt: skip
    plan, out, lse = run(case, t)
    assert (plan.cascade_groups, plan.cascade_requests) == (1, 2)
    ref_out, ref_lse = reference(case, t)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-4, rtol=2e-4)


def shared_and_copies(
    n: int, shared: int, own: int, ps: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, AttnBatch, AttnBatch]:
    """n decode requests whose tables start with the same `shared` pages, and the same
    requests over private copies of those pages (same values): (generator, k, v, shared
    batch, copies batch). bf16 K/V; the generator goes on to draw q."""
    num_pages = shared + n * own + n * shared
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, ps, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(num_pages, ps, kv_heads, dim, generator=gen).bfloat16()
    copy0 = shared + n * own
    for i in range(n):
        k[copy0 + i * shared : copy0 + (i + 1) * shared] = k[:shared]
        v[copy0 + i * shared : copy0 + (i + 1) * shared] = v[:shared]
    own_pages = [list(range(shared + i * own, shared + (i + 1) * own)) for i in range(n)]
    kv_lens = [(shared + own) * ps - i for i in range(n)]

    def batch(first: list[list[int]]) -> AttnBatch:
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1] * n, kv_lens=kv_lens,
            page_tables=[first[i] + own_pages[i] for i in range(n)], page_size=ps,
            num_pages=num_pages,
        )  # fmt: skip

    copies = [list(range(copy0 + i * shared, copy0 + (i + 1) * shared)) for i in range(n)]
    return gen, k, v, batch([list(range(shared))] * n), batch(copies)


def test_cascade_in_bf16_equals_private_copies() -> None:
    # The benchmark's shape in small (GQA 16/4, bf16 cache): shared pages vs copies of them.
    ps, n, shared, own = 16, 6, 8, 2
    cfg = AttnConfig("mha", 16, 4, 64, dtype="bfloat16", page_size=ps)
    gen, k, v, shared_b, copies_b = shared_and_copies(n, shared, own, ps, 4, 64, seed=3)
    be = NativeBackend(cfg, num_threads=2)
    q = torch.randn(n, 16, 64, generator=gen).bfloat16()
    plan_s = be.plan(shared_b)
    plan_p = be.plan(copies_b)
    assert (plan_s.cascade_groups, plan_p.cascade_groups) == (1, 0)
    h = be.handler(Phase.DECODE)
    a, la = h(q, k, v, plan_s, 0.125, return_lse=True)
    b, lb = h(q, k, v, plan_p, 0.125, return_lse=True)
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)


def test_cascade_option_through_bind() -> None:
    from attn_dispatch import BackendSpec
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch import record_dispatch

    case = case_of([[*PREFIX, 10], [*PREFIX, 11]], [90, 90])
    t = tensors(case)
    spec = BackendSpec(prefill="native", decode="native", verify="native")
    results = {}
    cfg = dataclasses.replace(t["cfg"], return_lse=True)
    for cascade in (True, False):
        runner = bind(spec, cfg, label=f"cascade={cascade}",
                      options={"native": {"cascade": cascade}})  # fmt: skip
        with record_dispatch() as rec, attn_scope(runner, t["batch"]):
            results[cascade] = attention(t["q"], t["k"], t["v"], sm_scale=D**-0.5, return_lse=True)
        notes = [e.note for e in rec.events]
        if cascade:
            assert notes == ["cascade: 2 requests in 1 group share 80 keys"]
            assert "cascade: 2 requests" in rec.summary()
        else:
            assert notes == [None]
    (out_on, lse_on), (out_off, lse_off) = results[True], results[False]
    torch.testing.assert_close(out_on, out_off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_on, lse_off, atol=1e-5, rtol=1e-5)
    ref_out, ref_lse = reference(case, t)
    torch.testing.assert_close(out_on.double(), ref_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse_on.double(), ref_lse, atol=2e-4, rtol=2e-4)


def test_cascade_option_refuses_non_bools() -> None:
    cfg = AttnConfig("mha", 4, 2, D, dtype="float32", page_size=16)
    with pytest.raises(InvalidSpecError, match="cascade"):
        NativeBackend(cfg, cascade="yes")  # type: ignore[arg-type]


def test_direct_handler_refuses_a_non_bool_return_lse() -> None:
    case = case_of([[*PREFIX, 10], [*PREFIX, 11]], [90, 90])
    t = tensors(case)
    be = NativeBackend(t["cfg"])
    with pytest.raises(InvalidBatchError, match="return_lse: native: must be True or False, got 1"):
        be.handler(Phase.DECODE)(t["q"], t["k"], t["v"], be.plan(t["batch"]), 0.2, return_lse=1)


def test_lse_with_sinks_counts_the_sink_once() -> None:
    # Head 0: no sink (-inf); head 1: a +inf sink takes all the weight (out 0, lse +inf);
    # head 2: a finite sink joins the sum once.
    cfg = AttnConfig("mha", 3, 1, D, dtype="float32", page_size=16, sinks=True)
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1], kv_lens=[20], page_tables=[[0, 1]], page_size=16,
        num_pages=2,
    )  # fmt: skip
    be = NativeBackend(cfg)
    q = torch.randn(1, 3, D)
    k, v = torch.randn(2, 16, 1, D), torch.randn(2, 16, 1, D)
    sinks = torch.tensor([-math.inf, math.inf, 0.5])
    out, lse = be.handler(Phase.DECODE)(
        q, k, v, be.plan(batch), D**-0.5, sinks=sinks, return_lse=True
    )
    keys = k.reshape(32, D)[:20]
    s = (q[0] @ keys.T) * D**-0.5
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s[0], 0), atol=1e-5, rtol=1e-5)
    assert lse[0, 1] == math.inf and bool((out[0, 1] == 0).all())
    with_sink = torch.logsumexp(torch.cat([s[2], torch.tensor([0.5])]), 0)
    torch.testing.assert_close(lse[0, 2], with_sink, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", () if isinstance(LIB, str) else LIB.isa_list)
@pytest.mark.parametrize("head_dim", [32, 20])  # 20: not a whole number of vectors
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_on_every_isa_path(isa: str, head_dim: int, dtype: str) -> None:
    # Every instruction-set path this CPU runs (and the path for head dims that are not a
    # multiple of the vector width): cascade equals the plain plan, out and lse.
    tables = [[*PREFIX, 10 + i] for i in range(5)] + [[*PREFIX]]
    kv_lens = [90, 91, 92, 93, 94, 80]
    cfg = AttnConfig("mha", 8, 2, head_dim, dtype=dtype, page_size=16, sinks=True)
    batch = AttnBatch.build(
        Phase.VERIFY, q_lens=[2] * 6, kv_lens=kv_lens, page_tables=tables, page_size=16,
        num_pages=16,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(12, 8, head_dim, generator=gen).to(getattr(torch, dtype))
    k = torch.randn(16, 16, 2, head_dim, generator=gen).to(getattr(torch, dtype))
    v = torch.randn(16, 16, 2, head_dim, generator=gen).to(getattr(torch, dtype))
    sinks = torch.randn(8, generator=gen)
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        got = {}
        for cascade in (True, False):
            be = NativeBackend(cfg, cascade=cascade, num_threads=2)
            plan = be.plan(batch)
            assert plan.cascade_groups == (1 if cascade else 0)
            got[cascade] = be.handler(Phase.VERIFY)(
                q, k, v, plan, head_dim**-0.5, sinks=sinks, return_lse=True
            )
    finally:
        LIB.set_isa(before)
    tol = 1e-5 if dtype == "float32" else 1e-2
    torch.testing.assert_close(got[True][0].float(), got[False][0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", () if isinstance(LIB, str) else LIB.isa_list)
@pytest.mark.parametrize(
    ("n", "shared", "items", "kv_dtype"),
    [(16, 8, 24, None), (12, 8, 20, None), (12, 64, 44, None), (16, 8, 24, "float8_e4m3fn")],
)
def test_wide_cascade_tiles_equal_private_copies(
    isa: str, n: int, shared: int, items: int, kv_dtype: str | None
) -> None:
    # GQA 32/8 x 128 in bf16, n decode requests sharing `shared` pages of 16 keys: the group's
    # n x 4 rows per kv head (64 or 48) make one cascade tile per kv head and key split (up to
    # kMaxCascadeRows = 64 rows), not one per 32 rows. Items: 16 requests -> 8 shared tiles +
    # 16 own (32 tiles of 32 rows counted: no split); 12 -> 28 counted, splits wanted 2: 128
    # shared keys stay whole (8 + 12), 1024 are cut in 2 x 2 (a wide tile stands for two) =
    # 4 chunks of 256 (32 + 12, as many items as two 32-row tiles cut in 2 each). Outputs equal
    # the private copies' on every ISA path (those without the wide kernel run 32-row tiles),
    # with a bf16 and an FP8 cache.
    ps, own = 16, 1
    cfg = AttnConfig("mha", 32, 8, 128, dtype="bfloat16", page_size=ps, kv_dtype=kv_dtype)
    gen, k, v, shared_b, copies_b = shared_and_copies(n, shared, own, ps, 8, 128, seed=5)
    if kv_dtype is not None:
        k, v = k.to(getattr(torch, kv_dtype)), v.to(getattr(torch, kv_dtype))
    q = torch.randn(n, 32, 128, generator=gen).bfloat16()
    assert shared_equals_copies(isa, cfg, q, k, v, shared_b, copies_b, {}) == items


def shared_equals_copies(
    isa: str,
    cfg: AttnConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    shared_b: AttnBatch,
    copies_b: AttnBatch,
    extras: dict[str, Any],
) -> int:
    """Decode over the shared pages (one cascade group) and over the private copies on ISA
    path `isa`: outputs and lse must agree. Returns the shared plan's item count."""
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        be = NativeBackend(cfg, num_threads=2)
        plan_s = be.plan(shared_b)
        plan_p = be.plan(copies_b)
        assert (plan_s.cascade_groups, plan_p.cascade_groups) == (1, 0)
        h = be.handler(Phase.DECODE)
        scale = cfg.head_dim**-0.5
        a, la = h(q, k, v, plan_s, scale, return_lse=True, **extras)
        b, lb = h(q, k, v, plan_p, scale, return_lse=True, **extras)
    finally:
        LIB.set_isa(before)
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    return int(plan_s.num_items)


@pytest.mark.parametrize("isa", () if isinstance(LIB, str) else LIB.isa_list)
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_mla_cascade_on_the_many_row_kernel_equals_private_copies(
    isa: str, kv_dtype: str | None
) -> None:
    # MLA 16 heads x 160/128 in bf16, 4 decode requests sharing 8 pages: the group's 64 rows
    # (4 x 16 heads of the one latent head) make one cascade tile, run whole by the vdpbf16ps
    # many-row kernel (MLA takes it from 16 rows), as 32-row tiles by the fp32 kernels. Outputs
    # and lse equal the private copies' on every ISA path, with a bf16 and an FP8 cache.
    ps, n, shared, own = 16, 4, 8, 2
    cfg = AttnConfig("mla", 16, 1, 160, 128, dtype="bfloat16", page_size=ps, kv_dtype=kv_dtype)
    gen, k, _, shared_b, copies_b = shared_and_copies(n, shared, own, ps, 1, 160, seed=9)
    k = k.squeeze(2)
    if kv_dtype is not None:
        k = k.to(getattr(torch, kv_dtype))
    q = torch.randn(n, 16, 160, generator=gen).bfloat16()
    extras = {} if kv_dtype is None else {"k_scale": 0.75}
    shared_equals_copies(isa, cfg, q, k, None, shared_b, copies_b, extras)
