"""The attention state (issue 24) on every backend that declares ``"lse"``.

``attention(..., return_lse=True)`` returns ``(out, lse)``: lse float32 ``[tokens, q_heads]``,
the natural log of the sum of exp(score) over the keys each query attended (scores after
sm_scale, the FP8 k_scale and the cap), the sink counted once. Checked against the float64
reference (``cases.reference_lse``) in every phase, kind, variant and FP8 format a backend
declares, and by what the state is for: attention over two disjoint key sets, merged with
``merge_state``, equals attention over their union. A backend joins by declaring ``"lse"``
in its ``Capabilities.variants``; where it does not (for a phase or kind), the test skips
naming that.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import merge_state
from attn_dispatch.backend import FormPolicy
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks
from tests import oracle
from tests.contract.cases import assert_lse_matches
from tests.contract.cases import lse_tolerance
from tests.contract.cases import materialise
from tests.contract.cases import naive_state
from tests.contract.cases import tolerance
from tests.contract.test_contract import BACKENDS
from tests.contract.test_contract import EDGE_CASES
from tests.contract.test_contract import FEW
from tests.contract.test_contract import FEW_EXAMPLES
from tests.contract.test_contract import LIMITS
from tests.contract.test_contract import THOROUGH
from tests.contract.test_contract import VARIANT_EDGES
from tests.contract.test_contract import _case
from tests.contract.test_contract import check_against_naive
from tests.contract.test_contract import device_for
from tests.contract.test_contract import served
from tests.contract.test_contract import skip_if_refused
from tests.contract.test_contract import skip_if_unavailable
from tests.strategies import DEFAULT_LIMITS
from tests.strategies import KernelCase
from tests.strategies import split_cases
from tests.strategies import variant_cases

LSE_EXAMPLES = 200 if THOROUGH else 30
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _examples(backend: str) -> int:
    return FEW if backend in FEW_EXAMPLES else LSE_EXAMPLES


def _declared(backend: str, kind: str, phase: Phase) -> tuple[object, list[str]]:
    serves, why = served(backend, kind, phase)
    if "lse" not in serves.variants:  # type: ignore[attr-defined]
        pytest.skip(f"{backend!r} does not declare 'lse' for {kind} {phase.name}: {'; '.join(why)}")
    return serves, why


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_matches_reference(backend: str, kind: str, phase: Phase) -> None:
    """Plain cases and every declared variant and FP8 format, with the state asked for."""
    skip_if_unavailable(backend)
    serves, _ = _declared(backend, kind, phase)
    limits = LIMITS.get(backend, DEFAULT_LIMITS)

    @settings(max_examples=_examples(backend), deadline=None, suppress_health_check=SLOW)
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=limits))  # type: ignore[arg-type]
    def check(case: KernelCase) -> None:
        check_against_naive(backend, dataclasses.replace(case, lse=True))

    check()


LSE_EDGES = {**EDGE_CASES, **VARIANT_EDGES}


@pytest.mark.parametrize("name", sorted(LSE_EDGES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_edge_cases(backend: str, name: str) -> None:
    skip_if_unavailable(backend)
    case = dataclasses.replace(LSE_EDGES[name], lse=True)
    skip_if_refused(backend, case)
    check_against_naive(backend, case)


def _part(m: object, tables: list[list[int]], kv_lens: list[int]) -> AttnBatch:
    c = m.config  # type: ignore[attr-defined]
    batch = AttnBatch.build(
        m.batch.phase,  # type: ignore[attr-defined]
        q_lens=m.batch.q_lens(),  # type: ignore[attr-defined]
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=c.page_size,
        num_pages=m.k_cache.shape[0],  # type: ignore[attr-defined]
    )
    return batch.to(m.q.device)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_of_split_keys_equals_union(backend: str, kind: str) -> None:
    """Each request's pages split in two (the first ``cut`` pages, the rest): attention over
    each part, merged with merge_state, is attention over all of them. Sinks go to the first
    part, -inf (no sink) to the second, so the sink is counted once."""
    skip_if_unavailable(backend)
    serves, _ = _declared(backend, kind, Phase.DECODE)
    limits = LIMITS.get(backend, DEFAULT_LIMITS)

    @settings(max_examples=_examples(backend), deadline=None, suppress_health_check=SLOW)
    @given(split=split_cases(kind=kind, served=serves, limits=limits))  # type: ignore[arg-type]
    def check(split: tuple[KernelCase, tuple[int, ...]]) -> None:
        case, cuts = split
        skip_if_refused(backend, case)  # a non-causal verify a backend does not declare
        m = materialise(case, device_for(backend))
        ps = case.page_size
        binding = bind(backend, m.config)
        kw = m.extras()
        parts = []
        for first in (True, False):
            tables = [t[:c] if first else t[c:] for t, c in zip(m.page_tables, cuts, strict=True)]
            lens = [
                c * ps if first else k - c * ps for k, c in zip(case.kv_lens, cuts, strict=True)
            ]
            if m.sinks is not None and not first:
                kw["sinks"] = torch.full_like(m.sinks, -math.inf)
            with attn_scope(binding, _part(m, tables, lens)):
                parts.append(
                    attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True, **kw)
                )
        (out_a, lse_a), (out_b, lse_b) = parts
        out, lse = merge_state(out_a, lse_a, out_b, lse_b)
        ref, ref_lse = naive_state(m)
        atol, rtol = tolerance(case.dtype)
        torch.testing.assert_close(out.cpu().double(), ref, atol=2 * atol, rtol=2 * rtol)
        assert_lse_matches(lse, m, ref_lse)
        # ... and equals the backend's own attention over the union.
        with attn_scope(binding, m.batch):
            kw = m.extras()
            whole, whole_lse = attention(
                m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True, **kw
            )
        torch.testing.assert_close(out, whole, atol=2 * atol, rtol=2 * rtol)
        latol, lrtol = lse_tolerance(case.dtype)
        torch.testing.assert_close(lse, whole_lse, atol=2 * latol, rtol=2 * lrtol)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_of_special_rows(backend: str) -> None:
    """A +inf sink: out 0 and lse +inf; a -inf sink: the state without a sink; NaN in one
    query row: that row's out and lse NaN, every other row untouched."""
    skip_if_unavailable(backend)
    case = _case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(20, 3), sinks=True, lse=True)
    skip_if_refused(backend, case)
    m = materialise(case, device_for(backend))
    binding = bind(backend, m.config)
    assert m.sinks is not None
    sinks = m.sinks.clone()
    sinks[1] = math.inf
    sinks[2] = -math.inf
    q = m.q.clone()
    q[1, 3] = math.nan
    with attn_scope(binding, m.batch):
        out, lse = attention(
            q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, sinks=sinks, return_lse=True
        )
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and lse[0, 1] == math.inf
    assert out[1, 3].isnan().all() and lse[1, 3].isnan()
    ok = torch.ones(2, 4, dtype=torch.bool)
    ok[1, 3] = False
    assert not out[ok].isnan().any() and not lse[ok].isnan().any()
    # The -inf sink (head 2) is no sink: the reference without sinks.
    plain = dataclasses.replace(case, sinks=False)
    pm = materialise(plain, device_for(backend))
    ref, ref_lse = naive_state(pm)
    torch.testing.assert_close(out[:, 2].double(), ref[:, 2], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse[:, 2].double(), ref_lse[:, 2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_of_an_empty_batch(backend: str) -> None:
    """SGLang's IDLE forward (no requests): an empty out and an empty lse."""
    skip_if_unavailable(backend)
    case = _case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(3,), lse=True)
    skip_if_refused(backend, case)
    m = materialise(case, device_for(backend))
    empty = AttnBatch.build(
        Phase.DECODE, q_lens=[], kv_lens=[], page_tables=[], page_size=case.page_size
    ).to(m.q.device)
    with attn_scope(bind(backend, m.config), empty):
        out, lse = attention(m.q[:0], m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4) and lse.dtype == torch.float32


def test_torch_row_that_sees_no_key_has_lse_minus_inf() -> None:
    """The reference's rule for a row that attended no key (no batch makes one: every query
    sees itself): out 0, lse -inf; with a finite sink, lse is the sink's logit."""
    from attn_dispatch.backends.reference.backend import _OnlineSoftmax

    q = torch.randn(1, 1, 2, 3, 4)  # [B, Hkv, G, Mq, D]
    acc = _OnlineSoftmax(q, 5)
    allowed = torch.zeros(1, 3, 6, dtype=torch.bool)
    allowed[0, 0] = True  # query 0 sees every key, queries 1 and 2 none
    acc.update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 5), allowed, 0.5)
    out, lse = acc.result(2), acc.lse(2)
    assert torch.equal(out[0, 1:], torch.zeros(2, 2, 5))
    assert torch.isneginf(lse[0, 1:]).all() and torch.isfinite(lse[0, 0]).all()
    sinks = torch.tensor([0.5, -1.0])
    with_sink = acc.lse(2, sinks)
    torch.testing.assert_close(with_sink[0, 1], sinks)
    torch.testing.assert_close(with_sink[0, 0], torch.logaddexp(lse[0, 0], sinks))


# -- MLA: the three forms give the same state ---------------------------------------------------

LAT, ROPE, NOPE, VD, H, PS = 16, 8, 12, 10, 2, 4


def _mla_config() -> AttnConfig:
    return AttnConfig(
        kind="mla",
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=LAT + ROPE,
        v_head_dim=LAT,
        dtype="float32",
        page_size=PS,
        mha_head_dim=NOPE + ROPE,
        mha_v_head_dim=VD,
        return_lse=True,
    )


@pytest.mark.parametrize(("q_lens", "prefix"), [([6, 3], [0, 0]), ([4, 2], [13, 22])])
def test_torch_mla_forms_give_the_same_state(q_lens: list[int], prefix: list[int]) -> None:
    """Absorbed (latent), decompressed one shot (MHA) and decompressed with prefix chunks
    (MHA_CHUNKED) compute the same scores, so the same lse; the chunked form returns it too."""
    g = torch.Generator().manual_seed(3)
    w_uk = torch.randn(H, NOPE, LAT, generator=g) / 4
    w_uv = torch.randn(H, VD, LAT, generator=g) / 4
    kv_lens = [q + p for q, p in zip(q_lens, prefix, strict=True)]
    tables, at = [], 0
    for k in kv_lens:
        n = -(-k // PS)
        tables.append(list(range(at, at + n)))
        at += n
    b = AttnBatch.build(
        Phase.PREFILL, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=PS
    )
    cache = torch.randn(at, PS, LAT + ROPE, generator=g)
    q_nope = torch.randn(b.num_tokens, H, NOPE, generator=g)
    q_rope = torch.randn(b.num_tokens, H, ROPE, generator=g)
    scale = 0.2

    def up_proj(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lat, rope = rows[:, :LAT], rows[:, LAT:]
        k_nope = torch.einsum("nl,hdl->nhd", lat, w_uk.to(rows.dtype))
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, H, -1)], dim=-1)
        return k, torch.einsum("nl,hvl->nhv", lat, w_uv.to(rows.dtype))

    policies = {
        AttnForm.MLA: FormPolicy.absorbed_only(),
        AttnForm.MHA: FormPolicy(short_prefix_max=10**6),
        AttnForm.MHA_CHUNKED: FormPolicy(no_prefix=AttnForm.MHA_CHUNKED, short_prefix_max=0),
    }
    states = {}
    q = torch.cat([q_nope, q_rope], dim=-1)
    for form, policy in policies.items():
        binding = bind("torch", _mla_config(), options={"torch": {"form_policy": policy}})
        with attn_scope(binding, b):
            assert attention_form() is form
            if form is AttnForm.MLA:
                q_abs = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_rope], dim=-1)
                lat_out, lse = attention(q_abs, cache, None, sm_scale=scale, return_lse=True)
                out = torch.einsum("thl,hvl->thv", lat_out, w_uv)
            elif form is AttnForm.MHA:
                k, v = up_proj(gather_latent(cache, b))
                out, lse = attention(q, k, v, sm_scale=scale, return_lse=True)
            else:
                full_k, full_v = up_proj(gather_latent(cache, b))
                ends = torch.cumsum(b.kv_lens_host, 0).tolist()
                new = torch.cat([torch.arange(e - n, e) for e, n in zip(ends, q_lens, strict=True)])
                chunks = latent_prefix_chunks(cache, b, up_proj, chunk_tokens=5)
                out, lse = attention(
                    q, full_k[new], full_v[new], sm_scale=scale, prefix=chunks, return_lse=True
                )
        assert lse.dtype == torch.float32 and lse.shape == (b.num_tokens, H)
        states[form] = (out, lse)
    ref_out, ref_lse = states[AttnForm.MLA]
    for form in (AttnForm.MHA, AttnForm.MHA_CHUNKED):
        out, lse = states[form]
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # ... and the absorbed state is the float64 one.
    # The oracle over the up-projected keys, one key per page, in gather order.
    k_all, v_all = up_proj(gather_latent(cache, b).double())
    starts = [0, *torch.cumsum(b.kv_lens_host, 0).tolist()]
    _, want = oracle.reference_state(
        q, k_all[:, None], v_all[:, None], q_lens=q_lens, kv_lens=kv_lens,
        page_tables=[list(range(starts[i], starts[i + 1])) for i in range(len(kv_lens))],
        sm_scale=scale,
    )  # fmt: skip
    torch.testing.assert_close(ref_lse.double(), want, atol=1e-5, rtol=1e-5)
