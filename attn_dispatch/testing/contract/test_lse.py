"""The attention state and the MLA forms, for a backend that declares them.

``attention(..., return_lse=True)`` returns ``(out, lse)``: lse float32 ``[tokens, q_heads]``,
the natural log of the sum of exp(score) over the keys each query attended (scores after
sm_scale, the FP8 k_scale and the cap), the sink counted once. Checked against the float64
oracle in every phase, kind, variant and FP8 format the backend declares, and by what the
state is for: attention over two disjoint key sets, merged with ``merge_state``, equals
attention over their union. A backend joins by declaring ``"lse"`` in its
``Capabilities.variants``; where it does not (for a phase or kind), the test skips naming
that. The decompressed MLA forms (``"mha"``, ``"mha_chunked"`` in ``Capabilities.forms``)
are checked against the oracle over the up-projected keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
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
from attn_dispatch import check
from attn_dispatch import merge_state
from attn_dispatch.backend import FormPolicy
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks
from attn_dispatch.testing.contract import oracle
from attn_dispatch.testing.contract.cases import EDGE_CASES
from attn_dispatch.testing.contract.cases import VARIANT_EDGES
from attn_dispatch.testing.contract.cases import KernelCase
from attn_dispatch.testing.contract.cases import Materialised
from attn_dispatch.testing.contract.cases import Served
from attn_dispatch.testing.contract.cases import assert_lse_matches
from attn_dispatch.testing.contract.cases import lse_tolerance
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.cases import naive_state
from attn_dispatch.testing.contract.cases import split_cases
from attn_dispatch.testing.contract.cases import tolerance
from attn_dispatch.testing.contract.cases import variant_cases
from attn_dispatch.testing.contract.harness import SLOW
from attn_dispatch.testing.contract.harness import Subject
from attn_dispatch.testing.contract.harness import contract_subject_fixture  # noqa: F401


def _declared(s: Subject, kind: str, phase: Phase) -> Served:
    s.require(kind=kind, phase=phase)
    s.shapes_for(kind)
    serves, why = s.served(kind, phase)
    if "lse" not in serves.variants:
        pytest.skip(
            f"{s.name!r} does not declare 'lse' for {kind} {phase.name.lower()}: "
            f"{'; '.join(why['lse'])}"
        )
    return serves


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_lse_matches_reference(attn_contract_subject: Subject, kind: str, phase: Phase) -> None:
    """Plain cases and every declared variant and FP8 format, with the state asked for."""
    s = attn_contract_subject
    serves = _declared(s, kind, phase)

    @settings(max_examples=s.profile.scaled(s.profile.lse_examples), deadline=None,
              suppress_health_check=SLOW)  # fmt: skip
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=s.limits))
    def check_one(case: KernelCase) -> None:
        s.check_drawn(dataclasses.replace(case, lse=True))

    check_one()


LSE_EDGES = {**EDGE_CASES, **VARIANT_EDGES}


@pytest.mark.parametrize("name", sorted(LSE_EDGES))
def test_lse_edge_cases(attn_contract_subject: Subject, name: str) -> None:
    s = attn_contract_subject
    s.check(s.declared(dataclasses.replace(LSE_EDGES[name], lse=True)))


def _part(m: Materialised, tables: list[list[int]], kv_lens: list[int]) -> AttnBatch:
    batch = AttnBatch.build(
        m.batch.phase,
        q_lens=m.batch.q_lens(),
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=m.config.page_size,
        num_pages=m.k_cache.shape[0],
    )
    return batch.to(m.q.device)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_merge_of_split_keys_equals_union(attn_contract_subject: Subject, kind: str) -> None:
    """Each request's pages split in two (the first ``cut`` pages, the rest): attention over
    each part, merged with merge_state, is attention over all of them. Sinks go to the first
    part, -inf (no sink) to the second, so the sink is counted once."""
    s = attn_contract_subject
    serves = _declared(s, kind, Phase.DECODE)

    @settings(max_examples=s.profile.scaled(s.profile.lse_examples), deadline=None,
              suppress_health_check=SLOW)  # fmt: skip
    @given(split=split_cases(kind=kind, served=serves, limits=s.limits))
    def check_one(split: tuple[KernelCase, tuple[int, ...]]) -> None:
        case, cuts = split
        if s.refused(case):  # a non-causal verify the backend does not declare
            return
        m = materialise(case, s.device)
        ps = case.page_size
        binding = bind(s.name, m.config)
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
            whole, whole_lse = attention(
                m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True, **m.extras()
            )
        torch.testing.assert_close(out, whole, atol=2 * atol, rtol=2 * rtol)
        latol, lrtol = lse_tolerance(case.dtype)
        torch.testing.assert_close(lse, whole_lse, atol=2 * latol, rtol=2 * lrtol)

    check_one()


def test_lse_of_special_rows(attn_contract_subject: Subject) -> None:
    """A +inf sink: out 0 and lse +inf; a -inf sink: the state without a sink; NaN in one
    query row: that row's out and lse NaN, every other row untouched."""
    s = attn_contract_subject
    case = s.declared(
        make_case(phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(20, 3), sinks=True, lse=True)
    )
    m = materialise(case, s.device)
    binding = bind(s.name, m.config)
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
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])), "a +inf sink: out must be 0"
    assert lse[0, 1] == math.inf, "a +inf sink: lse must be +inf"
    assert out[1, 3].isnan().all() and lse[1, 3].isnan(), "a NaN query row: NaN out and lse"
    ok = torch.ones(2, 4, dtype=torch.bool)
    ok[1, 3] = False
    assert not out[ok].isnan().any() and not lse[ok].isnan().any(), "NaN reached another row"
    # The -inf sink (head 2) is no sink: the reference without sinks.
    pm = materialise(dataclasses.replace(case, sinks=False), s.device)
    ref, ref_lse = naive_state(pm)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out[:, 2].double(), ref[:, 2], atol=atol, rtol=rtol)
    latol, lrtol = lse_tolerance(case.dtype)
    torch.testing.assert_close(lse[:, 2].double(), ref_lse[:, 2], atol=latol, rtol=lrtol)


def test_lse_of_an_empty_batch(attn_contract_subject: Subject) -> None:
    """SGLang's IDLE forward (no requests): an empty out and an empty lse."""
    s = attn_contract_subject
    case = s.declared(make_case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(3,), lse=True))
    m = materialise(case, s.device)
    empty = AttnBatch.build(
        Phase.DECODE, q_lens=[], kv_lens=[], page_tables=[], page_size=case.page_size
    ).to(m.q.device)
    with attn_scope(bind(s.name, m.config), empty):
        out, lse = attention(m.q[:0], m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True)
    want = (0, case.num_q_heads, case.v_head_dim)
    assert tuple(out.shape) == want and tuple(lse.shape) == want[:2]
    assert lse.dtype == torch.float32


# -- MLA: the decompressed forms ----------------------------------------------------------------

LAT, ROPE, NOPE, VD, H, PS = 16, 8, 12, 10, 2, 4
FORM_POLICIES = {
    "mha": FormPolicy(short_prefix_max=10**6),
    "mha_chunked": FormPolicy(no_prefix=AttnForm.MHA_CHUNKED, short_prefix_max=0),
}


@pytest.mark.parametrize("form", sorted(FORM_POLICIES))
@pytest.mark.parametrize(("q_lens", "prefix"), [([6, 3], [0, 0]), ([4, 2], [13, 22])])
def test_mla_decompressed_form_matches_reference(
    attn_contract_subject: Subject, form: str, q_lens: list[int], prefix: list[int]
) -> None:
    """A prefill in the decompressed form (K/V up-projected from the latent cache, one shot
    or in prefix chunks) equals the oracle over the same up-projected keys; the state too
    where the backend declares ``"lse"``."""
    s = attn_contract_subject
    s.require(kind="mla", phase=Phase.PREFILL)
    forms = s.caps.forms_for(Phase.PREFILL)
    if form not in forms:
        pytest.skip(
            f"{s.name!r} does not declare MLA form {form!r} for prefill "
            f"(Capabilities.forms={sorted(forms)!r})"
        )
    lse_on = "lse" in s.caps.variants_for(Phase.PREFILL)
    dtype = "float32" if "float32" in s.caps.dtypes else s.limits.dtypes[-1]
    config = AttnConfig(
        kind="mla",
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=LAT + ROPE,
        v_head_dim=LAT,
        dtype=dtype,
        page_size=PS,
        device=s.device,
        mha_head_dim=NOPE + ROPE,
        mha_v_head_dim=VD,
        return_lse=lse_on,
    )
    options = {s.name: {"form_policy": FORM_POLICIES[form]}}
    refused = check(s.name, config, options=options)
    if refused:
        why = "; ".join(r for _, (_, reasons) in sorted(refused.items()) for r in reasons)
        pytest.skip(f"outside {s.name!r}'s declared Capabilities: {why}")
    g = torch.Generator().manual_seed(3)
    tdtype = getattr(torch, dtype)
    w_uk = (torch.randn(H, NOPE, LAT, generator=g) / 4).to(tdtype)
    w_uv = (torch.randn(H, VD, LAT, generator=g) / 4).to(tdtype)
    kv_lens = [q + p for q, p in zip(q_lens, prefix, strict=True)]
    tables, at = [], 0
    for k in kv_lens:
        n = -(-k // PS)
        tables.append(list(range(at, at + n)))
        at += n
    b = AttnBatch.build(
        Phase.PREFILL, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=PS
    ).to(s.device)
    cache = torch.randn(at, PS, LAT + ROPE, generator=g).to(tdtype).to(s.device)
    q = torch.randn(b.num_tokens, H, NOPE + ROPE, generator=g).to(tdtype).to(s.device)
    scale = 0.2

    def up_proj(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lat, rope = rows[:, :LAT], rows[:, LAT:]
        k_nope = torch.einsum("nl,hdl->nhd", lat, w_uk.to(rows))
        k = torch.cat([k_nope, rope[:, None, :].expand(-1, H, -1)], dim=-1)
        return k, torch.einsum("nl,hvl->nhv", lat, w_uv.to(rows))

    full_k, full_v = up_proj(gather_latent(cache, b))
    kw: dict[str, Any] = {"return_lse": True} if lse_on else {}
    with attn_scope(bind(s.name, config, options=options), b):
        assert attention_form() is AttnForm(form)
        if form == "mha":
            result = attention(q, full_k, full_v, sm_scale=scale, **kw)
        else:
            ends = torch.cumsum(b.kv_lens_host, 0).tolist()
            new = torch.cat([torch.arange(e - n, e) for e, n in zip(ends, q_lens, strict=True)])
            chunks = latent_prefix_chunks(cache, b, up_proj, chunk_tokens=5)
            new = new.to(s.device)
            result = attention(q, full_k[new], full_v[new], sm_scale=scale, prefix=chunks, **kw)
    out, lse = result if lse_on else (result, None)
    # The oracle over the up-projected keys, one key per page, in gather order.
    starts = [0, *torch.cumsum(b.kv_lens_host, 0).tolist()]
    want, want_lse = oracle.reference_state(
        q, full_k[:, None], full_v[:, None], q_lens=q_lens, kv_lens=kv_lens,
        page_tables=[list(range(starts[i], starts[i + 1])) for i in range(len(kv_lens))],
        sm_scale=scale,
    )  # fmt: skip
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(out.cpu().double(), want, atol=atol, rtol=rtol)
    if lse is not None:
        latol, lrtol = lse_tolerance(dtype)
        torch.testing.assert_close(lse.cpu().double(), want_lse, atol=latol, rtol=lrtol)
