"""FP8 caches and the variants on the torch reference: per-call checks, bounded reads, the
window's page skipping (numbers themselves: tests/contract)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backends.reference import backend as ref


def _decode(context: int, ps: int, batch: int = 1) -> tuple[AttnBatch, int]:
    per = math.ceil(context / ps)
    pages = per * batch
    tables = [list(range(i * per, (i + 1) * per))[::-1] for i in range(batch)]
    b = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * batch,
        kv_lens=[context] * batch,
        page_tables=tables,
        page_size=ps,
        num_pages=pages,
    )
    return b, pages


def _cfg(**over: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="float32", page_size=16
    )
    base.update(over)
    return AttnConfig(**base)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_cache_dtype_must_be_the_fp8_format(fmt: str) -> None:
    cfg = _cfg(kv_dtype=fmt)
    b, pages = _decode(20, 16)
    q = torch.randn(1, 4, 32)
    good = torch.zeros(pages, 16, 2, 32).to(getattr(torch, fmt))
    with attn_scope(bind("torch", cfg), b):
        attention(q, good, good, sm_scale=1.0, k_scale=2.0, v_scale=0.5)
        with pytest.raises(InvalidBatchError) as info:
            attention(q, good.float(), good, sm_scale=1.0)
        assert info.value.field == "k_cache" and fmt in str(info.value)
        other = "float8_e5m2" if fmt == "float8_e4m3fn" else "float8_e4m3fn"
        with pytest.raises(InvalidBatchError) as info:
            attention(q, good, good.float().to(getattr(torch, other)), sm_scale=1.0)
        assert info.value.field == "v_cache"


def test_scales_scale_the_output() -> None:
    """V / v_scale stored, v_scale passed: the output is the same attention for any scale."""
    cfg = _cfg(kv_dtype="float8_e4m3fn")
    b, pages = _decode(37, 16)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 32, generator=g)
    k = torch.randn(pages, 16, 2, 32, generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(pages, 16, 2, 32, generator=g).to(torch.float8_e4m3fn)
    with attn_scope(bind("torch", cfg), b):
        one = attention(q, k, v, sm_scale=0.2)
        # Doubling the stored K and halving k_scale: the same keys (exact: a power of two,
        # no overflow for these values, and no subnormals as halving could make).
        k2 = (k.float() * 2).to(torch.float8_e4m3fn)
        assert torch.equal(k2.float(), k.float() * 2)
        same = attention(q, k2, v, sm_scale=0.2, k_scale=0.5)
        doubled = attention(q, k, v, sm_scale=0.2, v_scale=2.0)
    torch.testing.assert_close(one, same, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(doubled, one * 2, atol=1e-6, rtol=1e-6)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(keys gathered, keys any query may see) per chunk update."""
    seen: list[tuple[int, int]] = []
    real = ref._OnlineSoftmax.update

    def spy(self: Any, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, s: float) -> None:
        seen.append((k.shape[-2], int(allowed.any(dim=1).sum(dim=-1).max())))
        real(self, k, v, allowed, s)

    monkeypatch.setattr(ref._OnlineSoftmax, "update", spy)
    return seen


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_long_decode_is_chunked(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """A 20k-token FP8 decode: no step ever holds more than one chunk of dequantised keys."""
    cfg = _cfg(kind="mla", num_q_heads=2, num_kv_heads=1, head_dim=40, v_head_dim=32,
               kv_dtype=fmt, page_size=64)  # fmt: skip
    b, pages = _decode(20_000, 64)
    seen = _spy(monkeypatch)
    q = torch.randn(1, 2, 40)
    k = torch.randn(pages, 64, 40).to(getattr(torch, fmt))
    with attn_scope(bind("torch", cfg), b):
        attention(q, k, None, sm_scale=0.1, k_scale=0.5)
    assert max(n for n, _ in seen) == ref.CHUNK_TOKENS
    assert sum(n for n, _ in seen) >= 20_000


@pytest.mark.parametrize(("window", "ps"), [(0, 16), (100, 16), (1023, 64), (5, 1)])
def test_window_decode_gathers_only_the_window(
    monkeypatch: pytest.MonkeyPatch, window: int, ps: int
) -> None:
    """Decode reads window_left + 1 keys per request, rounded out to whole pages."""
    b, pages = _decode(8192, ps, batch=2)
    seen = _spy(monkeypatch)
    q = torch.randn(2, 4, 32)
    k = torch.randn(pages, ps, 2, 32)
    with attn_scope(bind("torch", _cfg(window_left=window, page_size=ps)), b):
        attention(q, k, k, sm_scale=0.1)
    gathered = sum(n for n, _ in seen)
    visible = sum(a for _, a in seen)
    assert visible == window + 1
    assert gathered <= (math.ceil((window + 1) / ps) + 1) * ps


def test_sinks_tensor_checked_per_call() -> None:
    b, pages = _decode(10, 16)
    q = torch.randn(1, 4, 32)
    k = torch.randn(pages, 16, 2, 32)
    with attn_scope(bind("torch", _cfg(sinks=True)), b):
        attention(q, k, k, sm_scale=0.1, sinks=torch.zeros(4))
        for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16), [0.0] * 4):
            with pytest.raises(InvalidBatchError) as info:
                attention(q, k, k, sm_scale=0.1, sinks=bad)
            assert info.value.field == "sinks"


def test_huge_sink_empties_the_output_and_nan_slots_stay_unread() -> None:
    """A sink far above every score takes all the weight (output -> 0); NaN in FP8 slots past
    kv_len never reaches the output."""
    cfg = _cfg(sinks=True, kv_dtype="float8_e4m3fn")
    b, pages = _decode(20, 16)
    q = torch.randn(1, 4, 32)
    k = torch.randn(pages, 16, 2, 32)
    k[0, 4:] = float("nan")  # page 0 is the last of the (reversed) table: positions 20..31
    k8 = k.to(torch.float8_e4m3fn)
    with attn_scope(bind("torch", cfg), b):
        out = attention(q, k8, k8, sm_scale=0.1, sinks=torch.full((4,), 1e4))
        normal = attention(q, k8, k8, sm_scale=0.1, sinks=torch.full((4,), -1e4))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-6
    assert torch.isfinite(normal).all() and normal.abs().max() > 1e-3


@pytest.mark.parametrize(
    ("window", "cap"), [(None, None), (0, None), (4, 2.0), (9, None), (50, 1.0)]
)
def test_chunked_form_applies_the_variants(window: int | None, cap: float | None) -> None:
    """The MLA 'mha_chunked' form (prefix in chunks, new tokens ragged) gives the paged MHA
    numbers for the same K/V, with the window (by position), the cap and sinks."""
    from attn_dispatch.backends.reference.backend import TorchBackend

    h, d, dv = 4, 24, 16
    cfg = AttnConfig(
        "mha", h, h, d, dv, dtype="float32", page_size=1, window_left=window, logit_cap=cap,
        sinks=True,
    )  # fmt: skip
    q_lens, prefix = [5, 3], [7, 20]
    kv_lens = [q + p for q, p in zip(q_lens, prefix, strict=True)]
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(n, h, d, generator=g) for n in kv_lens]
    vs = [torch.randn(n, h, dv, generator=g) for n in kv_lens]
    q = torch.randn(sum(q_lens), h, d, generator=g)
    sinks = torch.randn(h, generator=g)
    starts = [0, kv_lens[0]]
    b = AttnBatch.build(
        Phase.PREFILL,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=[list(range(s, s + n)) for s, n in zip(starts, kv_lens, strict=True)],
        page_size=1,
        num_pages=sum(kv_lens),
    )
    k_cache = torch.cat(ks)[:, None]
    v_cache = torch.cat(vs)[:, None]
    with attn_scope(bind("torch", cfg), b):
        paged = attention(q, k_cache, v_cache, sm_scale=0.3, sinks=sinks)
    # Prefix in chunks of up to 8 tokens per request, then the new tokens as ragged rows.
    chunks = []
    for c0 in range(0, max(prefix), 8):
        kp, vp, ind = [], [], [0]
        for i, p in enumerate(prefix):
            lo, hi = min(c0, p), min(c0 + 8, p)
            kp.append(ks[i][lo:hi])
            vp.append(vs[i][lo:hi])
            ind.append(ind[-1] + hi - lo)
        chunks.append((torch.cat(kp), torch.cat(vp), ind))
    k_new = torch.cat([k[p:] for k, p in zip(ks, prefix, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(vs, prefix, strict=True)])
    out = TorchBackend(cfg).run_chunked(q, k_new, v_new, b, 0.3, chunks, sinks=sinks)
    torch.testing.assert_close(out, paged, atol=1e-5, rtol=1e-5)
