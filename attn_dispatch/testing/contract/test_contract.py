"""The kernel contract: one backend (``--attn-backend NAME``), every phase and kind it
declares, against the float64 oracle.

Properties draw cases within the backend's limits (``harness.limits_for`` of its
``Capabilities``) with every layer variant and FP8 format it declares; fixed edge cases cover
the boundaries the draws reach by chance; the safety rules (inputs untouched, deterministic,
bad tensors refused with ``InvalidBatchError``, keys a row cannot see never reach it) hold
for every backend. What the backend does not declare skips, naming the capability.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import settings

from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.testing.contract.cases import EDGE_CASES
from attn_dispatch.testing.contract.cases import VARIANT_EDGES
from attn_dispatch.testing.contract.cases import KernelCase
from attn_dispatch.testing.contract.cases import kernel_cases
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.cases import naive_attention
from attn_dispatch.testing.contract.cases import tolerance
from attn_dispatch.testing.contract.cases import variant_cases
from attn_dispatch.testing.contract.harness import SLOW
from attn_dispatch.testing.contract.harness import Subject
from attn_dispatch.testing.contract.harness import contract_subject_fixture  # noqa: F401

PHASES = pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
KINDS = pytest.mark.parametrize("kind", ["mha", "mla"])


@PHASES
@KINDS
def test_matches_naive_reference(attn_contract_subject: Subject, kind: str, phase: Phase) -> None:
    s = attn_contract_subject
    s.require(kind=kind, phase=phase)
    s.shapes_for(kind)

    @settings(max_examples=s.profile.scaled(s.profile.examples), deadline=None,
              suppress_health_check=SLOW)  # fmt: skip
    @given(case=kernel_cases(kind=kind, phase=phase, limits=s.limits))
    def check(case: KernelCase) -> None:
        s.check_drawn(case)

    check()


@PHASES
@KINDS
def test_variants_match_naive_reference(
    attn_contract_subject: Subject, kind: str, phase: Phase
) -> None:
    """Windows (0, small, beyond the context), caps, sinks, attention types and FP8 caches
    (both formats, scales other than 1), alone and together, for what the backend declares."""
    s = attn_contract_subject
    s.require(kind=kind, phase=phase)
    s.shapes_for(kind)
    serves, why = s.served(kind, phase)
    if not serves.variants and not serves.fp8:
        refused = sorted({r for reasons in why.values() for r in reasons})
        pytest.skip(f"{s.name!r} declares no variant or FP8 cache here: {'; '.join(refused)}")

    @settings(max_examples=s.profile.scaled(s.profile.variant_examples), deadline=None,
              suppress_health_check=SLOW)  # fmt: skip
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=s.limits))
    def check(case: KernelCase) -> None:
        s.check_drawn(case)

    check()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases(attn_contract_subject: Subject, name: str) -> None:
    attn_contract_subject.check(attn_contract_subject.declared(EDGE_CASES[name]))


@pytest.mark.parametrize("name", sorted(VARIANT_EDGES))
def test_variant_edge_cases(attn_contract_subject: Subject, name: str) -> None:
    attn_contract_subject.check(attn_contract_subject.declared(VARIANT_EDGES[name]))


@KINDS
def test_single_chain_tree_equals_causal(attn_contract_subject: Subject, kind: str) -> None:
    """A verify tree that is one chain is the causal verify of the same tokens."""
    s = attn_contract_subject
    dims = dict(num_q_heads=2, num_kv_heads=1, head_dim=80, v_head_dim=64) if kind == "mla" else {}
    shape = dict(kind=kind, phase=Phase.VERIFY, q_lens=(5,), prefix_lens=(11,), **dims)
    chain = s.declared(make_case(trees=((-1, 0, 1, 2, 3),), **shape))
    causal = dataclasses.replace(chain, trees=None)
    out_tree, _ = s.run_case(chain)
    out_causal, _ = s.run_case(causal)
    atol, rtol = tolerance(chain.dtype)
    torch.testing.assert_close(out_tree, out_causal, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inputs_untouched_and_deterministic(attn_contract_subject: Subject, dtype: str) -> None:
    """Two calls on the same inputs give bit-identical outputs and leave q, K and V as they
    were, bit for bit."""
    s = attn_contract_subject
    s.require(dtype=dtype)
    case = s.declared(
        make_case(dtype=dtype, phase=Phase.VERIFY, q_lens=(3, 2), prefix_lens=(17, 4))
    )
    m = materialise(case, s.device)
    assert m.v_cache is not None
    before = [t.clone() for t in (m.q, m.k_cache, m.v_cache)]
    binding = bind(s.name, m.config)
    with attn_scope(binding, m.batch):
        a = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
        b = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    assert a.dtype == m.q.dtype
    assert torch.equal(a, b), f"{s.name!r}: two calls on the same inputs differ"
    for what, old, new in zip(("q", "k_cache", "v_cache"), before, (m.q, m.k_cache, m.v_cache),
                              strict=True):  # fmt: skip
        assert torch.equal(old, new), f"{s.name!r} modified its input {what}"


def test_input_checks(attn_contract_subject: Subject) -> None:
    """Tensors that do not fit the bound config raise ``InvalidBatchError`` naming them."""
    s = attn_contract_subject
    case = s.declared(
        make_case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(5,), dtype="bfloat16")
    )
    m = materialise(case, s.device)
    other = torch.float32 if m.q.dtype != torch.float32 else torch.bfloat16
    binding = bind(s.name, m.config)
    with attn_scope(binding, m.batch):
        with pytest.raises(InvalidBatchError, match="q") as err:
            attention(m.q[:, :3], m.k_cache, m.v_cache, sm_scale=m.sm_scale)  # wrong head count
        assert err.value.field == "q"
        with pytest.raises(InvalidBatchError, match="dtype"):
            attention(m.q.to(other), m.k_cache, m.v_cache, sm_scale=m.sm_scale)
        with pytest.raises(InvalidBatchError, match="k_cache"):
            narrow = m.k_cache[..., : case.head_dim // 2]  # wrong width
            attention(m.q, narrow, m.v_cache, sm_scale=m.sm_scale)
        with pytest.raises(InvalidBatchError):
            attention(m.q, m.k_cache, None, sm_scale=m.sm_scale)  # MHA needs a v_cache


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_unused_slots_are_unread(attn_contract_subject: Subject, poison: str) -> None:
    """Pages no request owns and the slots past each request's last token never reach the
    output, whatever they hold."""
    s = attn_contract_subject
    case = s.declared(make_case(q_lens=(3, 1), prefix_lens=(20, 40), extra_pages=3))
    m = materialise(case, s.device)
    ref = naive_attention(m)
    assert m.v_cache is not None
    ps, value = case.page_size, float(poison)
    owned = {p for table in m.page_tables for p in table}
    for page in range(m.k_cache.shape[0]):
        if page not in owned:
            m.k_cache[page] = value
            m.v_cache[page] = value
    for table, kv_len in zip(m.page_tables, case.kv_lens, strict=True):
        if kv_len % ps:
            m.k_cache[table[-1], kv_len % ps :] = value
            m.v_cache[table[-1], kv_len % ps :] = value
    with attn_scope(bind(s.name, m.config), m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)


def test_window_beyond_context_equals_full(attn_contract_subject: Subject) -> None:
    s = attn_contract_subject
    wide = s.declared(make_case(q_lens=(4, 2), prefix_lens=(50, 3), window_left=54))
    full = dataclasses.replace(wide, window_left=None)
    a, _ = s.run_case(wide)
    b, _ = s.run_case(full)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_window_slots_outside_are_unread(attn_contract_subject: Subject) -> None:
    """Keys before a decode's window never reach the output, whatever they hold (NaN)."""
    s = attn_contract_subject
    case = s.declared(
        make_case(
            phase=Phase.DECODE,
            q_lens=(1,),
            prefix_lens=(99,),
            window_left=20,
            page_size=16,
            extra_pages=0,
        )
    )
    m = materialise(case, s.device)
    ref = naive_attention(m)
    table, ps = m.page_tables[0], case.page_size
    assert m.v_cache is not None
    for t in range(0, 100 - 21):  # positions 0..78 are outside the window of position 99
        m.k_cache[table[t // ps], t % ps] = float("nan")
        m.v_cache[table[t // ps], t % ps] = float("nan")
    with attn_scope(bind(s.name, m.config), m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
