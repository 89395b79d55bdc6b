"""The ``sdpa`` backend: its own rules beyond the contract suite (tests/contract/ runs it on
every phase, kind, variant and FP8 format it declares, with the LSE and merge tests).

Here: both ways of running a block after a cached prefix (two parts merged by LSE, one
masked call) against the float64 reference, the plan's grouping and in-place reads, the MLA
forms, what it refuses at bind and at the call, unread cache slots holding NaN, threads that
share a plan, and CUDA (skipped without a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
from attn_dispatch.backend import list_backends
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks
from tests.contract.cases import assert_lse_matches
from tests.contract.cases import materialise
from tests.contract.cases import naive_state
from tests.contract.cases import tolerance
from tests.strategies import DEFAULT_LIMITS
from tests.strategies import KernelCase
from tests.strategies import Served
from tests.strategies import kernel_cases
from tests.strategies import variant_cases

SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
SERVED = Served(
    variants=frozenset({"window", "sinks", "non_causal", "chunked", "lse"}),
    fp8=("float8_e4m3fn", "float8_e5m2"),
)


def run(case: KernelCase, **options: object) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    m = materialise(case)
    binding = bind("sdpa", m.config, options={"sdpa": options} if options else None)
    kw = m.extras()
    if case.lse:
        kw["return_lse"] = True
    with attn_scope(binding, m.batch):
        res = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **kw)
    out, lse = res if case.lse else (res, None)
    return out, lse, m


def check(case: KernelCase, **options: object) -> None:
    out, lse, m = run(case, **options)
    ref, ref_lse = naive_state(m)  # type: ignore[arg-type]
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    if lse is not None:
        assert_lse_matches(lse, m, ref_lse)  # type: ignore[arg-type]


@pytest.mark.parametrize("extend", ["split", "mask"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.VERIFY], ids=lambda p: p.name.lower())
def test_both_extend_modes_match_reference(extend: str, kind: str, phase: Phase) -> None:
    """Every variant the backend declares, with the block after a prefix forced to two parts
    merged by LSE or to one masked call (the default ``auto`` runs in the contract suite)."""

    @settings(max_examples=25, deadline=None, suppress_health_check=SLOW)
    @given(case=variant_cases(kind=kind, phase=phase, served=SERVED), lse=st.booleans())
    def prop(case: KernelCase, lse: bool) -> None:
        check(dataclasses.replace(case, lse=lse), extend=extend)

    prop()


@settings(max_examples=20, deadline=None, suppress_health_check=SLOW)
@given(case=kernel_cases(kind="mha", phase=Phase.PREFILL), block=st.integers(1, 9))
def test_small_window_blocks_match_reference(case: KernelCase, block: int) -> None:
    """Windowed prefill cut into tiny query blocks (each a masked call over its band)."""
    check(dataclasses.replace(case, window_left=3), window_block=block)


def _case(**over: object) -> KernelCase:
    base: dict[str, object] = dict(
        kind="mha", phase=Phase.PREFILL, num_q_heads=4, num_kv_heads=2, head_dim=64,
        v_head_dim=64, page_size=4, dtype="float32", q_lens=(5, 5), prefix_lens=(7, 7),
        trees=None, extra_pages=3, seed=3,
    )  # fmt: skip
    base.update(over)
    return KernelCase(**base)  # type: ignore[arg-type]


def _plan(case: KernelCase, **options: object) -> object:
    m = materialise(case)
    binding = bind("sdpa", m.config, options={"sdpa": options} if options else None)
    return binding.plan(m.batch)


def test_split_and_mask_give_the_same_state() -> None:
    """Prefix + causal square merged by LSE equals one bottom-right masked call."""
    case = _case(q_lens=(6, 3), prefix_lens=(9, 20), lse=True, sinks=True)
    a, la, _ = run(case, extend="split")
    b, lb, _ = run(case, extend="mask")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert la is not None and lb is not None
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_uniform_batch_is_one_call_and_decode_is_grouped() -> None:
    # (in_place=False: a request whose shuffled pages happen to be consecutive would be read
    # in place, from another source, and so not grouped.)
    plan = _plan(_case(q_lens=(5, 5, 5), prefix_lens=(0, 0, 0)), in_place=False)
    assert plan.call_counts == (3,)  # type: ignore[attr-defined]
    plan = _plan(
        _case(phase=Phase.DECODE, q_lens=(1, 1, 1, 1), prefix_lens=(9, 9, 9, 30)), in_place=False
    )
    assert plan.call_counts == (3, 1)  # type: ignore[attr-defined]
    # Two parts per call after a prefix with extend="split"; one masked call with "mask".
    plan = _plan(_case(q_lens=(40, 40), prefix_lens=(9, 9)), extend="split")
    assert plan.call_parts == (2,)  # type: ignore[attr-defined]
    plan = _plan(_case(q_lens=(40, 40), prefix_lens=(9, 9)), extend="mask")
    assert plan.call_parts == (1,)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kv_heads", "option", "in_place"),
    [(2, None, 0), (2, True, 1), (2, False, 0), (1, None, 1), (1, False, 0)],
)
def test_consecutive_pages_read_in_place_where_the_layout_is_as_fast(
    kv_heads: int, option: bool | None, in_place: int
) -> None:
    """A request whose pages follow each other can be a view of the cache (no gather). On
    CPU ``auto`` does that only with one KV head (rows already head-major): with more, the
    flash kernel is slower on the cache's layout than the gather costs. Every way gives the
    reference's numbers."""
    cfg = AttnConfig("mha", 4, kv_heads, 16, dtype="float32", page_size=4)
    batch = AttnBatch.build(
        Phase.PREFILL, q_lens=[3, 2], kv_lens=[10, 6], page_tables=[[2, 3, 4], [7, 0]],
        page_size=4, num_pages=8,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=g)
    k = torch.randn(8, 4, kv_heads, 16, generator=g)
    v = torch.randn(8, 4, kv_heads, 16, generator=g)
    options = None if option is None else {"sdpa": {"in_place": option}}
    outs = {}
    for name in ("sdpa", "torch"):
        with attn_scope(bind(name, cfg, options=options if name == "sdpa" else None), batch):
            outs[name] = attention(q, k, v, sm_scale=0.25)
    plan = bind("sdpa", cfg, options=options).plan(batch)
    assert plan.in_place == in_place  # type: ignore[attr-defined]
    gathered = [7, 0] if in_place else [2, 3, 4, 7, 0]
    assert plan.gathered == tuple(gathered)  # type: ignore[attr-defined]
    torch.testing.assert_close(outs["sdpa"], outs["torch"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("min_bytes", [0, 1 << 50], ids=["per-run copies", "index_select"])
@pytest.mark.parametrize(
    "over",
    [
        {},
        {"v_head_dim": 32},  # V padded to q/k's width: zero columns in a reused buffer
        {"kind": "mla", "head_dim": 80, "v_head_dim": 64, "num_kv_heads": 1},
        {"kv_dtype": "float8_e4m3fn", "k_scale": 0.5, "v_scale": 2.0},
    ],
    ids=["mha", "narrow-v", "mla", "fp8"],
)
def test_both_cpu_gathers_match_reference(
    monkeypatch: pytest.MonkeyPatch, min_bytes: int, over: dict[str, object]
) -> None:
    """The CPU gather copies run by run, or (runs too short for a copy each) index_selects
    into scratch and transposes; both give the reference's numbers, over two forwards of
    different sizes that reuse the buffers."""
    from attn_dispatch.backends.sdpa import _gather as sdpa_gather

    monkeypatch.setattr(sdpa_gather, "RUN_COPY_MIN_BYTES", min_bytes)
    monkeypatch.setattr(sdpa_gather, "RUN_COPY_MAX_RUNS", 1 << 30)
    check(_case(q_lens=(5, 3), prefix_lens=(9, 14), seed=5, **over))
    check(_case(q_lens=(2,), prefix_lens=(3,), seed=6, **over))


# -- refusals ------------------------------------------------------------------------------------


def test_logit_cap_refused_at_bind_with_the_reason() -> None:
    cfg = AttnConfig("mha", 4, 2, 64, dtype="float32", page_size=16, logit_cap=30.0)
    with pytest.raises(IncompatibleBackendError) as err:
        bind("sdpa", cfg)
    text = str(err.value)
    assert "logit_cap" in text and "soft-cap" in text
    caps = list_backends()["sdpa"]
    for phase in Phase:
        assert caps.variants_for(phase) == {"window", "sinks", "non_causal", "chunked", "lse"}
        assert caps.forms_for(phase) == {"mla", "mha", "mha_chunked"}


def test_bad_options_refused() -> None:
    cfg = AttnConfig("mha", 4, 2, 64, dtype="float32", page_size=16)
    for opts in ({"extend": "fast"}, {"window_block": 0}, {"in_place": 1}, {"in_place": "yes"}):
        with pytest.raises((InvalidSpecError, IncompatibleBackendError)):
            bind("sdpa", cfg, options={"sdpa": opts})


def test_out_of_range_page_refused_at_the_call() -> None:
    case = _case()
    m = materialise(case)
    binding = bind("sdpa", m.config)
    small = m.k_cache[: max(max(t) for t in m.page_tables)]  # the largest page is missing
    with attn_scope(binding, m.batch), pytest.raises(InvalidBatchError) as err:
        attention(m.q, small.contiguous(), m.v_cache[: small.shape[0]].contiguous(), sm_scale=0.1)
    assert err.value.field == "kv_indices"


def test_other_backends_plan_refused() -> None:
    m = materialise(_case())
    a, b = bind("sdpa", m.config), bind("sdpa", m.config)
    plan = a.plan(m.batch)
    run_b = b.backend(Phase.PREFILL).handler(Phase.PREFILL)
    with pytest.raises(InvalidBatchError) as err:
        run_b(m.q, m.k_cache, m.v_cache, plan, 0.1)
    assert err.value.field == "plan"
    run_a = a.backend(Phase.PREFILL).handler(Phase.DECODE)
    with pytest.raises(InvalidBatchError) as err:  # a prefill plan given to decode
        run_a(m.q, m.k_cache, m.v_cache, plan, 0.1)
    assert err.value.field == "phase"


def test_non_contiguous_cache_refused() -> None:
    m = materialise(_case())
    binding = bind("sdpa", m.config)
    k = m.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    with attn_scope(binding, m.batch), pytest.raises(InvalidBatchError) as err:
        attention(m.q, k, m.v_cache, sm_scale=0.1)
    assert err.value.field == "k_cache"


# -- safety --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
def test_nan_in_unread_slots_never_reaches_the_output(kind: str, phase: Phase) -> None:
    """Slots past kv_len and pages in no table hold NaN: the output equals the clean one."""
    q_lens = (1, 1) if phase is Phase.DECODE else (3, 2)
    dims = dict(head_dim=80, v_head_dim=64, num_q_heads=4, num_kv_heads=1) if kind == "mla" else {}
    case = _case(kind=kind, phase=phase, q_lens=q_lens, prefix_lens=(6, 9), **dims)
    m = materialise(case)
    ref, _ = naive_state(m)
    used = {(p, s) for i, t in enumerate(m.page_tables) for p, s in _slots(t, case, i)}
    for page in range(m.k_cache.shape[0]):
        for slot in range(case.page_size):
            if (page, slot) not in used:
                m.k_cache[page, slot] = math.nan
                if m.v_cache is not None:
                    m.v_cache[page, slot] = math.nan
    binding = bind("sdpa", m.config)
    with attn_scope(binding, m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _slots(table: list[int], case: KernelCase, i: int) -> list[tuple[int, int]]:
    ps = case.page_size
    return [(table[t // ps], t % ps) for t in range(case.kv_lens[i])]


def test_nan_in_q_gives_nan_in_that_row_only() -> None:
    m = materialise(_case(q_lens=(3, 2), prefix_lens=(4, 5)))
    m.q[1, 0] = math.nan
    binding = bind("sdpa", m.config)
    with attn_scope(binding, m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    assert out[1, 0].isnan().all()
    rest = torch.ones(out.shape[:2], dtype=torch.bool)
    rest[1, 0] = False
    assert not out[rest].isnan().any()


def test_plan_is_immune_to_later_batch_edits() -> None:
    m = materialise(_case(q_lens=(3, 2), prefix_lens=(4, 5)))
    binding = bind("sdpa", m.config)
    with attn_scope(binding, m.batch):
        before = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
        m.batch.kv_indices.zero_()
        after = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_threads_sharing_a_plan_match_serial() -> None:
    """Each thread gathers into its own buffer: concurrent layers give the serial numbers."""
    m = materialise(_case(q_lens=(17, 9), prefix_lens=(40, 3), dtype="bfloat16"))
    binding = bind("sdpa", m.config)
    plan = binding.plan(m.batch)
    handler = binding.handler(Phase.PREFILL)
    serial = handler(m.q, m.k_cache, m.v_cache, plan, m.sm_scale)
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                results.append(handler(m.q, m.k_cache, m.v_cache, plan, m.sm_scale))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(r, serial) for r in results) and len(results) == 20


# -- MLA forms -----------------------------------------------------------------------------------

H, LATENT, ROPE, NOPE, VDIM, PS = 2, 64, 16, 32, 24, 4


def _mla_forms(q_lens: list[int], prefix: list[int], form: AttnForm, **cfg: object) -> torch.Tensor:
    kv = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    tables, nxt = [], 0
    for k in kv:
        n = math.ceil(k / PS)
        tables.append(list(range(nxt, nxt + n))[::-1])
        nxt += n
    b = AttnBatch.build(Phase.PREFILL, q_lens=q_lens, kv_lens=kv, page_tables=tables, page_size=PS)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(nxt + 1, PS, LATENT + ROPE, generator=g)
    w_uk = torch.randn(H, NOPE, LATENT, generator=g) / 8
    w_uv = torch.randn(H, VDIM, LATENT, generator=g) / 8
    q_nope = torch.randn(b.num_tokens, H, NOPE, generator=g)
    q_rope = torch.randn(b.num_tokens, H, ROPE, generator=g)

    def up(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, r = rows[:, :LATENT], rows[:, LATENT:]
        k = torch.cat([torch.einsum("nl,hdl->nhd", c, w_uk), r[:, None].expand(-1, H, -1)], -1)
        return k, torch.einsum("nl,hvl->nhv", c, w_uv)

    policy = {
        AttnForm.MLA: FormPolicy.absorbed_only(),
        AttnForm.MHA: FormPolicy(short_prefix_max=10**6),
        AttnForm.MHA_CHUNKED: FormPolicy(no_prefix=AttnForm.MHA_CHUNKED, short_prefix_max=0),
    }[form]
    config = AttnConfig(
        "mla", H, 1, LATENT + ROPE, LATENT, dtype="float32", page_size=PS,
        mha_head_dim=NOPE + ROPE, mha_v_head_dim=VDIM, **cfg,  # type: ignore[arg-type]
    )  # fmt: skip
    binding = bind("sdpa", config, options={"sdpa": {"form_policy": policy}})
    scale = 1 / math.sqrt(NOPE + ROPE)
    with attn_scope(binding, b):
        if form is AttnForm.MLA:
            q = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_rope], dim=-1)
            lat = attention(q, cache, None, sm_scale=scale)
            return torch.einsum("thl,hvl->thv", lat, w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1)
        full_k, full_v = up(gather_latent(cache, b))
        if form is AttnForm.MHA:
            return attention(q, full_k, full_v, sm_scale=scale)  # type: ignore[no-any-return]
        ends = torch.cumsum(b.kv_lens_host, 0).tolist()
        new = torch.cat([torch.arange(e - ql, e) for e, ql in zip(ends, b.q_lens(), strict=True)])
        chunks = latent_prefix_chunks(cache, b, up, chunk_tokens=5)
        return attention(q, full_k[new], full_v[new], sm_scale=scale, prefix=chunks)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "variant", [{}, {"window_left": 4}, {"attention_chunk_size": 6}, {"causal": False}]
)
@pytest.mark.parametrize(
    ("q_lens", "prefix"), [([6, 3], [0, 0]), ([4, 2], [13, 22]), ([1, 5], [30, 1])]
)
def test_three_mla_forms_agree(
    q_lens: list[int], prefix: list[int], variant: dict[str, object]
) -> None:
    """Absorbed (latent, K as V), decompressed (V padded 24 -> 48) and chunked-prefix
    (parts merged by LSE) give the same layer output."""
    outs = {f: _mla_forms(q_lens, prefix, f, **variant) for f in AttnForm}
    for form in (AttnForm.MHA, AttnForm.MHA_CHUNKED):
        torch.testing.assert_close(outs[form], outs[AttnForm.MLA], atol=1e-5, rtol=1e-5)


# -- FP8 and mixed dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_cache_dtype_differs_from_q(kv_dtype: str) -> None:
    """FP8 is widened to q's dtype with the scales; a 16-bit cache under fp32 q runs in fp32."""
    fp8 = kv_dtype.startswith("float8")
    case = _case(q_lens=(4, 1), prefix_lens=(11, 6), dtype="float32",
                 kv_dtype=kv_dtype if fp8 else None,
                 k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0)  # fmt: skip
    if fp8:
        check(case)
        return
    m = materialise(case)
    cfg = dataclasses.replace(m.config, kv_dtype=kv_dtype)
    k16, v16 = m.k_cache.to(torch.bfloat16), m.v_cache.to(torch.bfloat16)  # type: ignore[union-attr]
    m.k_cache, m.v_cache = k16.float(), v16.float()
    ref, _ = naive_state(m)
    with attn_scope(bind("sdpa", cfg), m.batch):
        out = attention(m.q, k16, v16, sm_scale=m.sm_scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.cuda  # bench/gpu.sh runs `pytest -m cuda` on the GPU machine
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
def test_cuda_matches_reference(phase: Phase) -> None:
    for dtype in ("bfloat16", "float16"):
        for lse, sinks in ((False, False), (True, True)):
            q_lens = (1, 1) if phase is Phase.DECODE else (5, 3)
            case = _case(phase=phase, q_lens=q_lens, prefix_lens=(30, 70), dtype=dtype,
                         lse=lse, sinks=sinks, page_size=16)  # fmt: skip
            m = materialise(case, "cuda")
            kw = m.extras()
            if lse:
                kw["return_lse"] = True
            with attn_scope(bind("sdpa", m.config), m.batch):
                res = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **kw)
            out, got_lse = res if lse else (res, None)
            ref, ref_lse = naive_state(m)
            atol, rtol = tolerance(dtype)
            torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
            if got_lse is not None:
                assert_lse_matches(got_lse.cpu(), m, ref_lse)


def test_limits_cover_the_defaults() -> None:
    """The contract suite draws sdpa cases from the default limits (every head size there
    is served, V padded where it differs)."""
    assert DEFAULT_LIMITS.mha_dims and not list_backends()["sdpa"].availability_reasons()
