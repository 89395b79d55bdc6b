"""The attention state over every built-in backend: the kit's suite
(``attn_dispatch.testing.contract.test_lse``, parametrised by conftest.py), and the torch
reference's own rules (its online softmax, its three MLA forms giving one state)."""

from __future__ import annotations

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import FormPolicy
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks
from attn_dispatch.testing.contract import oracle
from attn_dispatch.testing.contract.test_lse import *  # noqa: F403  (the kit's tests)


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
