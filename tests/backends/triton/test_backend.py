"""Triton backend against the float64 oracle (tests/oracle.py).

On a machine without CUDA the kernels run under triton's CPU interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is *defined*, i.e. when ``attn_dispatch.backends.triton.
backend`` is first imported (at bind). This module sets it at import, which pytest does while
collecting, before any test of the session binds the backend: so the contract suite's triton
cases in the same pytest process run under the interpreter too. Shapes stay tiny: the
interpreter costs tens of ms per program instance.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import BackendSpec
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import merge_state
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch.backend import window_tree_mask
from attn_dispatch.backends.triton import CAPABILITIES
from attn_dispatch.backends.triton import _ops
from attn_dispatch.backends.triton._dims import DimLayout
from attn_dispatch.backends.triton._dims import dim_reasons
from attn_dispatch.backends.triton._ops import choose_num_splits
from attn_dispatch.backends.triton.backend import TritonBackend
from attn_dispatch.backends.triton.backend import kernel_config
from tests import oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# fp32 accumulates the same sums in another order; bf16 output is rounded to 8 bits of mantissa.
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


# ---------------------------------------------------------------- batches and reference


def make_batch(
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    *,
    mask: torch.Tensor | None = None,
    spare_pages: int = 3,
    seed: int = 0,
    raw: bool = False,
) -> tuple[Any, int]:
    """An AttnBatch with its pages scattered at random over the cache.

    ``raw=True`` gives a plain namespace with the same fields instead, for what AttnBatch
    itself refuses (a query row that may attend to nothing) or to poison fields.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-k // page_size) for k in kv_lens]
    total_pages = sum(pages_per) + spare_pages
    order = torch.randperm(total_pages, generator=g).to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32)
    mask_indptr = None
    if mask is not None:
        sizes = [q * k for q, k in zip(q_lens, kv_lens, strict=True)]
        mask_indptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    if not raw:
        real = AttnBatch(
            phase,
            qo_indptr,
            kv_indptr,
            order[: sum(pages_per)].contiguous(),
            kv_lens_t,
            custom_mask=mask,
            page_size=page_size,
            num_pages=total_pages,
        )
        return (real if DEVICE == "cpu" else real.to(DEVICE)), total_pages
    batch = SimpleNamespace(
        phase=phase,
        page_size=page_size,
        qo_indptr=qo_indptr.to(DEVICE),
        kv_indptr=kv_indptr.to(DEVICE),
        kv_indices=order[: sum(pages_per)].contiguous().to(DEVICE),
        kv_lens=kv_lens_t.to(DEVICE),
        custom_mask=None if mask is None else mask.to(DEVICE),
        mask_indptr=None if mask_indptr is None else mask_indptr.to(DEVICE),
        qo_indptr_host=qo_indptr,
        kv_indptr_host=kv_indptr,
        kv_lens_host=kv_lens_t,
        num_requests=len(q_lens),
        num_tokens=sum(q_lens),
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
    )
    return batch, total_pages


def reference(*args: Any, **variants: Any) -> torch.Tensor:
    """The output of ``reference_state`` (same arguments)."""
    return reference_state(*args, **variants)[0]


def reference_state(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: Any,
    sm_scale: float,
    v_head_dim: int,
    *,
    window_left: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    causal: bool = True,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle (tests/oracle.py) on this batch, with the variants given as
    keywords: ``(out, lse)``, out rounded once to float32 (what these tests compare the
    kernels' outputs with), lse float64."""
    q_lens, kv_lens, tables, masks = oracle.batch_layout(batch)
    out, lse = oracle.reference_state(
        q, k_cache, v_cache, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, masks=masks,
        sm_scale=sm_scale, v_head_dim=v_head_dim, causal=causal, window_left=window_left,
        chunk=chunk, logit_cap=logit_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return out.float(), lse


def run_case(
    kind: str,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    dtype: str,
    *,
    mask: torch.Tensor | None = None,
    raw: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(1)
    cfg = AttnConfig(
        kind,  # type: ignore[arg-type]
        hq,
        hkv,
        d,
        dv,
        dtype=dtype,
        page_size=page_size,
        device=DEVICE,
        tree_verify=mask is not None,
    )
    assert CAPABILITIES.reasons(cfg, phase) == []
    backend = TritonBackend(cfg, **options)
    batch, pages = make_batch(phase, q_lens, kv_lens, page_size, mask=mask, raw=raw)
    tdt = DTYPES[dtype]
    q = torch.randn(batch.num_tokens, hq, d).to(tdt).to(DEVICE)
    if kind == "mla":
        k_cache, v_cache = torch.randn(pages, page_size, d).to(tdt).to(DEVICE), None
    else:
        k_cache = torch.randn(pages, page_size, hkv, d).to(tdt).to(DEVICE)
        v_cache = torch.randn(pages, page_size, hkv, dv).to(tdt).to(DEVICE)
    scale = 1.0 / math.sqrt(d)
    plan = backend.plan(batch)
    out = backend.handler(phase)(q, k_cache, v_cache, plan, scale)
    assert out.shape == (batch.num_tokens, hq, dv) and out.dtype == tdt
    ref = reference(q, k_cache, v_cache, batch, scale, dv)
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out, ref, plan


def tree_mask(q_lens: list[int], kv_lens: list[int], seed: int = 0) -> torch.Tensor:
    """Speculative tree: every draft node sees the whole prefix, its ancestors and itself."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        prefix = kv_len - q_len
        parent = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, q_len)]
        block = torch.zeros(q_len, kv_len, dtype=torch.bool)
        block[:, :prefix] = True
        for j in range(q_len):
            node = j
            while node >= 0:
                block[j, prefix + node] = True
                node = parent[node]
        blocks.append(block.flatten())
    return torch.cat(blocks)


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize(
    ("page_size", "dtype", "splits"), [(16, "float32", 3), (1, "bfloat16", 2), (16, "float16", 1)]
)
def test_mha_gqa_decode(page_size: int, dtype: str, splits: int) -> None:
    # 8 query heads over 2 KV heads; kv lengths that end mid-page and mid-block.
    _, _, plan = run_case(
        "mha", 8, 2, 64, 64, Phase.DECODE, [1, 1, 1], [5, 40, 17], page_size, dtype,
        num_kv_splits=splits,
    )  # fmt: skip
    assert plan.num_splits == splits


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mla_decode_576_512_several_splits(dtype: str) -> None:
    _, _, plan = run_case(
        "mla", 16, 1, 576, 512, Phase.DECODE, [1, 1], [30, 70], 16, dtype, num_kv_splits=4
    )
    assert plan.num_splits == 4


def test_mla_decode_small_latent_split_rule() -> None:
    # 80 = 64 latent + 16 rope. The split count comes from the rule (not forced): with a
    # target of 4 programs and >= 32 tokens a split, 2 requests x 1 head group split in 2.
    _, _, plan = run_case(
        "mla", 4, 1, 80, 64, Phase.DECODE, [1, 1], [30, 70], 4, "bfloat16",
        target_programs=4, min_split_tokens=32,
    )  # fmt: skip
    assert plan.num_splits == 2


@pytest.mark.parametrize(("page_size", "dtype"), [(1, "float32"), (16, "bfloat16")])
def test_mha_prefill_with_prefix(page_size: int, dtype: str) -> None:
    # Request 0: 3 new tokens after 7 cached; request 1: 20 new after 20 (two query blocks).
    run_case("mha", 4, 2, 64, 32, Phase.PREFILL, [3, 20], [10, 40], page_size, dtype)


def test_mha_prefill_without_prefix_odd_head_dim() -> None:
    # head_dim 96 = 64 + 32 and v 48 padded to 64: masked lanes must not leak in.
    run_case("mha", 2, 1, 96, 48, Phase.PREFILL, [17, 5], [17, 5], 16, "bfloat16")


def test_mla_prefill_with_prefix() -> None:
    run_case("mla", 2, 1, 576, 512, Phase.PREFILL, [5, 2], [21, 9], 16, "bfloat16")


@pytest.mark.parametrize(("kind", "page_size", "dtype"), [("mha", 16, "float32"),
                                                         ("mla", 1, "bfloat16")])  # fmt: skip
def test_verify_with_tree_mask(kind: str, page_size: int, dtype: str) -> None:
    q_lens, kv_lens = [4, 6], [13, 38]
    mask = tree_mask(q_lens, kv_lens)
    d, dv, hkv = (80, 64, 1) if kind == "mla" else (64, 64, 2)
    out, _, _ = run_case(
        kind, 4, hkv, d, dv, Phase.VERIFY, q_lens, kv_lens, page_size, dtype, mask=mask
    )
    # The tree is not a chain: causal attention would give other numbers.
    causal, _, _ = run_case(kind, 4, hkv, d, dv, Phase.VERIFY, q_lens, kv_lens, page_size, dtype)
    assert not torch.allclose(out.cpu().float(), causal.cpu().float(), atol=1e-2)


def test_verify_fully_masked_row_is_zero_not_nan() -> None:
    q_lens, kv_lens = [3, 2], [8, 20]
    mask = tree_mask(q_lens, kv_lens)
    mask[8:16] = False  # request 0, query row 1 sees nothing
    # AttnBatch refuses such a mask; the kernel must still be safe, so feed it directly.
    out, _, _ = run_case("mha", 2, 1, 32, 32, Phase.VERIFY, q_lens, kv_lens, 4, "float32",
                         mask=mask, raw=True)  # fmt: skip
    assert torch.isfinite(out).all()
    assert out[1].abs().max().item() == 0.0
    assert out[0].abs().max().item() > 0.0


def test_one_token_verify_with_mask_uses_the_mask() -> None:
    # One draft token per request with a mask that hides part of the prefix: the plan must
    # pick the masked kernel, not the split-KV decode path.
    q_lens, kv_lens = [1, 1], [9, 16]
    mask = torch.rand(sum(kv_lens), generator=torch.Generator().manual_seed(3)) < 0.5
    mask[0] = True
    mask[9] = True
    run_case("mha", 4, 2, 32, 32, Phase.VERIFY, q_lens, kv_lens, 16, "float32", mask=mask)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_bind_and_dispatch_through_attn_scope(kind: str) -> None:
    # The registry path: bind by name with options, plan at scope entry, attention() per layer.
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    cfg = AttnConfig(kind, 4, hkv, d, dv, dtype="float32", page_size=4, device=DEVICE)  # type: ignore[arg-type]
    binding = bind(
        BackendSpec.uniform("triton"), cfg, label="target", options={"triton": {"num_kv_splits": 2}}
    )
    runner = SimpleNamespace(attn_binding=binding)
    batch, pages = make_batch(Phase.DECODE, [1, 1], [7, 30], 4)
    q = torch.randn(2, 4, d, device=DEVICE)
    if kind == "mla":
        k_cache, v_cache = torch.randn(pages, 4, d, device=DEVICE), None
    else:
        k_cache = torch.randn(pages, 4, hkv, d, device=DEVICE)
        v_cache = torch.randn(pages, 4, hkv, dv, device=DEVICE)
    with attn_scope(runner, batch):
        out = attention(q, k_cache, v_cache, sm_scale=0.25)
        if kind == "mla":
            assert attention_form() is AttnForm.MLA  # absorbed form in every phase
    ref = reference(q, k_cache, v_cache, batch, 0.25, dv)
    torch.testing.assert_close(out.cpu(), ref, atol=TOL["float32"], rtol=TOL["float32"])


# ---------------------------------------------------------------- layer variants and FP8

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def run_variant(
    kind: str,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    dtype: str,
    *,
    window: int | None = None,
    cap: float | None = None,
    sinks: bool = False,
    fp8: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    mask: torch.Tensor | None = None,
    poison_before: int | None = None,
    tol: float | None = None,
    causal: bool = True,
    chunk: int | None = None,
    lse: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, Any]:
    """One variant case against the float64 reference; ``poison_before=n`` puts NaN in every
    cached key and value at positions < kv_len - n of each request after the reference is
    taken (the kernel must never load them). ``lse=True``: the handler is called with
    ``return_lse=True`` too; its lse must match the reference's and its output the plain
    call's."""
    torch.manual_seed(2)
    cfg = AttnConfig(
        kind,  # type: ignore[arg-type]
        hq,
        hkv,
        d,
        dv,
        dtype=dtype,
        kv_dtype=fp8,
        page_size=page_size,
        device=DEVICE,
        tree_verify=mask is not None,
        window_left=window,
        logit_cap=cap,
        sinks=sinks,
        causal=causal,
        attention_chunk_size=chunk,
    )
    assert CAPABILITIES.reasons(cfg, phase) == []
    backend = TritonBackend(cfg, **options)
    batch, pages = make_batch(phase, q_lens, kv_lens, page_size, mask=mask)
    tdt = DTYPES[dtype]
    kdt = FP8[fp8] if fp8 else tdt
    q = torch.randn(batch.num_tokens, hq, d).to(tdt).to(DEVICE)
    # FP8: values spread over the format's range, stored as K / k_scale (docs/guides/fp8.md).
    spread = 3.0 if fp8 else 1.0
    if kind == "mla":
        k_cache, v_cache = (torch.randn(pages, page_size, d) * spread).to(kdt).to(DEVICE), None
    else:
        k_cache = (torch.randn(pages, page_size, hkv, d) * spread).to(kdt).to(DEVICE)
        v_cache = (torch.randn(pages, page_size, hkv, dv) * spread).to(kdt).to(DEVICE)
    sink_t = (torch.randn(hq) * 2).to(DEVICE) if sinks else None
    scale = 1.0 / math.sqrt(d)
    ref, ref_lse = reference_state(
        q, k_cache, v_cache, batch, scale, dv, window_left=window, logit_cap=cap, sinks=sink_t,
        k_scale=k_scale, v_scale=k_scale if kind == "mla" else v_scale, causal=causal,
        chunk=chunk,
    )  # fmt: skip
    if poison_before is not None:
        _poison_before(batch, k_cache, v_cache, page_size, poison_before)
    extras: dict[str, Any] = {}
    if sinks:
        extras["sinks"] = sink_t
    if fp8:
        extras["k_scale"] = k_scale
        if kind == "mha":
            extras["v_scale"] = v_scale
    plan = backend.plan(batch)
    out = backend.handler(phase)(q, k_cache, v_cache, plan, scale, **extras)
    assert out.shape == (batch.num_tokens, hq, dv) and out.dtype == tdt
    t = tol if tol is not None else TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=t, rtol=t)
    if lse:
        both = backend.handler(phase)(q, k_cache, v_cache, plan, scale, return_lse=True, **extras)
        check_state(both, out, ref_lse)
    return out, plan


#: lse is a sum of fp32 exponentials of scores that both sides compute from the same
#: (rounded) inputs: what differs is the fp32 accumulation.
LSE_TOL = 2e-4


def check_state(state: Any, out: torch.Tensor, ref_lse: torch.Tensor) -> torch.Tensor:
    """``state`` is ``(out, lse)`` per the contract, with ``out`` the plain call's output and
    lse close to the float64 reference (-inf, +inf and NaN where it has them)."""
    assert isinstance(state, tuple) and len(state) == 2
    got, lse = state
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:2]
    assert lse.is_contiguous() and lse.device == out.device
    # The same kernel, with the lse store switched on: the output does not change.
    torch.testing.assert_close(got, out, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(
        lse.cpu().double(), ref_lse, atol=LSE_TOL, rtol=LSE_TOL, equal_nan=True
    )
    return lse


def _poison_before(
    batch: Any, k_cache: torch.Tensor, v_cache: torch.Tensor | None, page_size: int, keep: int
) -> None:
    nan_k = torch.tensor(float("nan")).to(k_cache.dtype)
    for i in range(batch.num_requests):
        kv_len = int(batch.kv_lens_host[i])
        pages = batch.kv_indices.cpu()[int(batch.kv_indptr_host[i]) :].long()
        for pos in range(max(0, kv_len - keep)):
            page, slot = int(pages[pos // page_size]), pos % page_size
            k_cache[page, slot] = nan_k
            if v_cache is not None:
                v_cache[page, slot] = nan_k


@pytest.mark.parametrize(
    ("kind", "dtype", "window", "cap", "sinks"),
    [
        ("mha", "float32", 10, None, False),
        ("mha", "float32", 0, 5.0, True),  # window 0: the query sees only itself
        ("mha", "bfloat16", 500, 2.0, True),  # window larger than the context
        ("mla", "float32", 13, 4.0, True),
    ],
)
def test_decode_variants(
    kind: str, dtype: str, window: int | None, cap: float | None, sinks: bool
) -> None:
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    run_variant(kind, 4, hkv, d, dv, Phase.DECODE, [1, 1, 1], [37, 70, 5], 4, dtype,
                window=window, cap=cap, sinks=sinks, num_kv_splits=3)  # fmt: skip


def test_decode_window_never_loads_keys_before_the_window() -> None:
    # NaN in every key and value before each request's window: had the split range begun
    # before the window (and merely masked), NaN * 0 would reach the output.
    out, plan = run_variant("mha", 4, 2, 32, 32, Phase.DECODE, [1, 1], [70, 9], 4, "float32",
                            window=12, poison_before=13, num_kv_splits=2)  # fmt: skip
    assert torch.isfinite(out).all()
    assert plan.num_splits == 2


def test_window_bounds_the_decode_split_count() -> None:
    # The split rule sees at most window_left + 1 keys per request, not the context.
    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=4, device=DEVICE)
    batch, _ = make_batch(Phase.DECODE, [1], [4000], 4)
    full = TritonBackend(cfg).plan(batch)
    windowed = TritonBackend(cfg.replace(window_left=31)).plan(batch)
    assert full.kernel == windowed.kernel == "decode"
    assert full.num_splits > windowed.num_splits == 1


@pytest.mark.parametrize(
    ("kind", "window", "cap", "sinks"),
    [("mha", 5, 1.5, True), ("mha", 0, None, False), ("mla", 9, 3.0, True)],
)
def test_prefill_with_prefix_variants(
    kind: str, window: int | None, cap: float | None, sinks: bool
) -> None:
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    run_variant(kind, 4, hkv, d, dv, Phase.PREFILL, [5, 20], [40, 20], 4, "float32",
                window=window, cap=cap, sinks=sinks)  # fmt: skip


def test_extend_window_never_loads_keys_before_the_window() -> None:
    # One query block per request: keys before (first query's position - window_left) are
    # never loaded, so NaN there cannot reach the output.
    q_lens, kv_lens, window = [6, 3], [50, 30], 7
    out, _ = run_variant("mha", 2, 1, 32, 32, Phase.PREFILL, q_lens, kv_lens, 4, "float32",
                         window=window, poison_before=max(q_lens) + window)  # fmt: skip
    assert torch.isfinite(out).all()


def test_tree_verify_window_counts_a_nodes_own_sequence() -> None:
    # Drafts 0 <- 1, 0 <- 2 <- 3 after a prefix of 10. With window_left 3, node 3's sequence
    # ends prefix[9], d0, d2, d3: it sees key 9, which a positional window (keys >= 13 - 3)
    # would hide; node 1 (sequence ..., prefix[8], prefix[9], d0, d1) sees keys 8 and 9.
    prefix, parents = 10, [-1, 0, 0, 2]
    rows = []
    for node in range(4):
        row = torch.zeros(prefix + 4, dtype=torch.bool)
        row[:prefix] = True
        at = node
        while at >= 0:
            row[prefix + at] = True
            at = parents[at]
        rows.append(row)
    mask = torch.stack(rows)
    win = window_tree_mask(mask, 3)
    assert win[3, 9] and not win[3, 8] and win[1, 8] and not win[1, 7]
    run_variant("mha", 2, 1, 32, 32, Phase.VERIFY, [4], [prefix + 4], 4, "float32",
                mask=mask.reshape(-1), window=3, extend_block_m=16)  # fmt: skip


def test_tree_verify_with_window_cap_and_sinks() -> None:
    q_lens, kv_lens = [3, 2], [9, 20]
    run_variant("mha", 4, 2, 32, 32, Phase.VERIFY, q_lens, kv_lens, 4, "float32",
                mask=tree_mask(q_lens, kv_lens), window=6, cap=2.5, sinks=True)  # fmt: skip


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize(
    ("kind", "phase", "dtype"),
    [
        ("mha", Phase.DECODE, "bfloat16"),
        ("mha", Phase.PREFILL, "float32"),
        ("mla", Phase.DECODE, "float32"),
        ("mla", Phase.VERIFY, "bfloat16"),
    ],
)
def test_fp8_cache(fmt: str, kind: str, phase: Phase, dtype: str) -> None:
    # The reference dequantises the same FP8 bytes in float64: what remains is the output's
    # own rounding (bf16) and the fp32 accumulation.
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    q_lens = [1, 1] if phase is Phase.DECODE else [4, 2]
    tol = 4 * TOL[dtype] if dtype == "bfloat16" else 1e-4  # outputs are ~3x larger
    run_variant(kind, 4, hkv, d, dv, phase, q_lens, [21, 40], 4, dtype, fp8=fmt,
                k_scale=0.37, v_scale=2.5, tol=tol, num_kv_splits=2)  # fmt: skip


def test_fp8_cache_with_every_variant() -> None:
    run_variant("mha", 4, 1, 32, 32, Phase.PREFILL, [3, 7], [30, 12], 4, "float32",
                fp8="float8_e4m3fn", k_scale=1.7, v_scale=0.3, window=8, cap=6.0,
                sinks=True, tol=1e-4)  # fmt: skip


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_variants_and_fp8_through_attention(phase: Phase) -> None:
    # The registry path: bind checks the declarations (the variant "lse" included),
    # attention() passes sinks, scales and return_lse.
    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", kv_dtype="float8_e5m2", page_size=4,
                     device=DEVICE, window_left=6, logit_cap=3.0, sinks=True,
                     return_lse=True)  # fmt: skip
    binding = bind(BackendSpec.uniform("triton"), cfg, label="target")
    runner = SimpleNamespace(attn_binding=binding)
    q_lens = [1, 1] if phase is Phase.DECODE else [4, 3]
    batch, pages = make_batch(phase, q_lens, [19, 11], 4)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(batch.num_tokens, 4, 32, generator=gen).to(DEVICE)
    k = (torch.randn(pages, 4, 2, 32, generator=gen) * 4).to(torch.float8_e5m2).to(DEVICE)
    v = (torch.randn(pages, 4, 2, 32, generator=gen) * 4).to(torch.float8_e5m2).to(DEVICE)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    with attn_scope(runner, batch):
        out = attention(q, k, v, sm_scale=0.2, sinks=sinks, k_scale=0.25, v_scale=0.5)
        state = attention(q, k, v, sm_scale=0.2, sinks=sinks, k_scale=0.25, v_scale=0.5,
                          return_lse=True)  # fmt: skip
    ref, ref_lse = reference_state(q, k, v, batch, 0.2, 32, window_left=6, logit_cap=3.0,
                                   sinks=sinks, k_scale=0.25, v_scale=0.5)  # fmt: skip
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    check_state(state, out, ref_lse)


def test_handler_checks_sinks_and_scales() -> None:
    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=4, device=DEVICE)
    batch, pages = make_batch(Phase.DECODE, [1], [9], 4)
    q = torch.randn(1, 4, 32, device=DEVICE)
    k = torch.randn(pages, 4, 2, 32, device=DEVICE)
    v = torch.randn(pages, 4, 2, 32, device=DEVICE)
    with_sinks = TritonBackend(cfg.replace(sinks=True))
    run = with_sinks.handler(Phase.DECODE)
    plan = with_sinks.plan(batch)
    for bad in (None, torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(2, 4)):
        with pytest.raises(InvalidBatchError) as err:
            run(q, k, v, plan, 0.2, sinks=bad)
        assert err.value.field == "sinks"
    plain = TritonBackend(cfg)
    with pytest.raises(InvalidBatchError) as err:
        plain.handler(Phase.DECODE)(q, k, v, plain.plan(batch), 0.2, sinks=torch.zeros(4))
    assert err.value.field == "sinks"
    with pytest.raises(InvalidBatchError) as err:
        plain.handler(Phase.DECODE)(q, k, v, plain.plan(batch), 0.2, k_scale=2.0)
    assert err.value.field == "k_scale"
    # An FP8 config given a 16-bit cache: the cache dtype check names it.
    fp8 = TritonBackend(cfg.replace(kv_dtype="float8_e5m2"))
    with pytest.raises(InvalidBatchError) as err:
        fp8.handler(Phase.DECODE)(q, k, v, fp8.plan(batch), 0.2, k_scale=1.0, v_scale=1.0)
    assert err.value.field == "k_cache"


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_loads_widen_exactly(fmt: str) -> None:
    # The kernels widen FP8 loads with .to(): every finite code must come out as torch
    # decodes it (under the interpreter too). The NaN/Inf codes are left out: the interpreter
    # decodes them as large finite numbers (the module docstring says so).
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def widen(src, dst, n: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.arange(0, n)
        tl.store(dst + offs, tl.load(src + offs).to(tl.float32))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[fmt]).to(DEVICE)
    got = torch.empty(256, device=DEVICE)
    widen[(1,)](codes, got, n=256)
    want = codes.float()
    finite = torch.isfinite(want)
    assert int(finite.sum()) >= 248
    assert torch.equal(got[finite].cpu(), want[finite].cpu())


def test_e4m3_needs_sm89_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AttnConfig("mha", 8, 2, 64, 64, dtype="bfloat16", kv_dtype="float8_e4m3fn",
                     device="cuda")  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    from attn_dispatch.backends.triton import _fp8_check

    assert any("sm89" in r for r in _fp8_check(cfg, Phase.DECODE))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert list(_fp8_check(cfg, Phase.DECODE)) == []
    assert list(_fp8_check(cfg.replace(kv_dtype="float8_e5m2"), Phase.DECODE)) == []


def test_e4m3_probe_gives_a_reason_when_it_cannot_inspect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device the probe cannot read is never taken for sm89+: no CUDA visible, or a
    device index that does not exist, each gives a reason naming why."""
    from attn_dispatch.backends.triton import _fp8_check

    cfg = AttnConfig("mha", 8, 2, 64, 64, dtype="bfloat16", kv_dtype="float8_e4m3fn",
                     device="cuda:3")  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = list(_fp8_check(cfg, Phase.DECODE))
    assert len(reasons) == 1 and "could not be read" in reasons[0], reasons
    assert "no CUDA device" in reasons[0] and "'cuda:3'" in reasons[0]

    def missing(device: object = None) -> tuple[int, int]:
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", missing)
    reasons = list(_fp8_check(cfg, Phase.DECODE))
    assert len(reasons) == 1 and "Invalid device id" in reasons[0], reasons
    # e5m2 needs no probe: nothing to refuse
    assert list(_fp8_check(cfg.replace(kv_dtype="float8_e5m2"), Phase.DECODE)) == []


# ---------------------------------------------------------------- LSE (attention state)


@pytest.mark.parametrize(
    ("kind", "phase", "dtype", "variant"),
    [
        ("mha", Phase.DECODE, "float32", {}),
        ("mla", Phase.DECODE, "bfloat16", {}),
        ("mha", Phase.DECODE, "float32", {"window": 10, "cap": 5.0, "sinks": True}),
        ("mla", Phase.DECODE, "float32", {"window": 13, "cap": 4.0, "sinks": True}),
        ("mha", Phase.DECODE, "float32", {"chunk": 16}),
        ("mha", Phase.PREFILL, "float32", {}),
        ("mha", Phase.PREFILL, "bfloat16", {"window": 5, "cap": 1.5, "sinks": True}),
        ("mla", Phase.PREFILL, "float32", {"window": 9, "cap": 3.0, "sinks": True}),
        ("mha", Phase.PREFILL, "float32", {"causal": False, "sinks": True}),
        ("mha", Phase.PREFILL, "float32", {"chunk": 8}),
        ("mha", Phase.VERIFY, "float32", {"tree": True, "window": 6, "cap": 2.5, "sinks": True}),
        ("mla", Phase.VERIFY, "bfloat16", {"tree": True}),
        ("mha", Phase.DECODE, "bfloat16", {"fp8": "float8_e4m3fn", "cap": 6.0, "sinks": True}),
        ("mla", Phase.DECODE, "float32", {"fp8": "float8_e5m2", "window": 11}),
        ("mha", Phase.PREFILL, "float32", {"fp8": "float8_e5m2", "window": 8, "sinks": True}),
        ("mla", Phase.VERIFY, "float32", {"fp8": "float8_e4m3fn", "tree": True, "cap": 5.0}),
    ],
)
def test_lse_matches_the_float64_reference(
    kind: str, phase: Phase, dtype: str, variant: dict[str, Any]
) -> None:
    # Every phase (split-KV decode with several splits, extend with a prefix, tree verify),
    # MHA/GQA and MLA, each variant and FP8 cache: lse = log(sum exp(score) [+ exp(sink)]).
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    opts = dict(variant)
    q_lens = {Phase.DECODE: [1, 1, 1], Phase.PREFILL: [5, 20, 3], Phase.VERIFY: [4, 6, 2]}[phase]
    kv_lens = [37, 70, 5] if phase is Phase.DECODE else [40, 20, 13]
    mask = tree_mask(q_lens, kv_lens) if opts.pop("tree", False) else None
    fp8 = opts.get("fp8")
    tol = (4 * TOL[dtype] if dtype == "bfloat16" else 1e-4) if fp8 else None
    scales = {"k_scale": 0.37, "v_scale": 2.5} if fp8 else {}
    run_variant(kind, 4, hkv, d, dv, phase, q_lens, kv_lens, 4, dtype, mask=mask, tol=tol,
                lse=True, num_kv_splits=3, **scales, **opts)  # fmt: skip


def _state_backend(**cfg: Any) -> tuple[TritonBackend, Any]:
    config = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=4, device=DEVICE)
    backend = TritonBackend(config.replace(**cfg), num_kv_splits=2)
    return backend, backend.handler(Phase.DECODE)


def _state_case(phase: Phase, q_lens: list[int], seed: int, **cfg: Any) -> SimpleNamespace:
    """A small GQA case (4 q heads over 2 kv heads, 32 wide): backend, handler, batch, q/k/v."""
    backend, run = _state_backend(**cfg)
    batch, pages = make_batch(phase, q_lens, [19, 11], 4)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.num_tokens, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(pages, 4, 2, 32, generator=g).to(DEVICE)
    v = torch.randn(pages, 4, 2, 32, generator=g).to(DEVICE)
    return SimpleNamespace(backend=backend, run=run, batch=batch, q=q, k=k, v=v)


def test_lse_of_a_row_that_sees_no_key_is_minus_inf() -> None:
    # Request 0, query row 1 sees nothing (a raw mask: AttnBatch refuses it): out 0, lse -inf.
    # With a sink the same row's lse is the sink (it saw only the sink) and out is still 0.
    q_lens, kv_lens = [3, 2], [8, 20]
    mask = tree_mask(q_lens, kv_lens)
    mask[8:16] = False
    batch, pages = make_batch(Phase.VERIFY, q_lens, kv_lens, 4, mask=mask, raw=True)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(pages, 4, 2, 32, generator=g).to(DEVICE)
    v = torch.randn(pages, 4, 2, 32, generator=g).to(DEVICE)
    sinks = torch.randn(4, generator=g).to(DEVICE)
    for with_sinks in (False, True):
        backend, run = _state_backend(tree_verify=True, sinks=with_sinks)
        extra = {"sinks": sinks} if with_sinks else {}
        out, lse = run(q, k, v, backend.plan(batch), 0.2, return_lse=True, **extra)
        assert (out[1] == 0).all()
        if with_sinks:
            torch.testing.assert_close(lse[1].cpu(), sinks.cpu())
        else:
            assert torch.isneginf(lse[1]).all()
        others = torch.cat([lse[:1], lse[2:]])
        assert torch.isfinite(others).all()
        ref_out, ref_lse = reference_state(q, k, v, batch, 0.2, 32, sinks=extra.get("sinks"))
        torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=LSE_TOL, rtol=LSE_TOL)
        torch.testing.assert_close(out.cpu(), ref_out, atol=TOL["float32"], rtol=TOL["float32"])


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_lse_with_non_finite_sinks(phase: Phase) -> None:
    # Per head: +inf takes all the weight (out 0, lse +inf), -inf is no sink (the plain
    # result), NaN gives NaN in both, a finite sink is counted once.
    c = _state_case(phase, [1, 1] if phase is Phase.DECODE else [4, 3], 6, sinks=True)
    sinks = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.7]).to(DEVICE)
    out, lse = c.run(c.q, c.k, c.v, c.backend.plan(c.batch), 0.2, sinks=sinks, return_lse=True)
    assert (out[:, 0] == 0).all() and torch.isposinf(lse[:, 0]).all()
    assert out[:, 2].isnan().all() and lse[:, 2].isnan().all()
    finite = torch.tensor([-1e30, float("-inf"), 0.0, 0.7])  # the reference's no-sink: -inf
    ref_out, ref_lse = reference_state(c.q, c.k, c.v, c.batch, 0.2, 32, sinks=finite)
    for h in (1, 3):
        torch.testing.assert_close(lse[:, h].cpu().double(), ref_lse[:, h], atol=LSE_TOL,
                                   rtol=LSE_TOL)  # fmt: skip
        torch.testing.assert_close(out[:, h].cpu(), ref_out[:, h], atol=TOL["float32"],
                                   rtol=TOL["float32"])  # fmt: skip


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_lse_of_a_row_that_read_nan_is_nan(phase: Phase) -> None:
    q_lens = [1, 1] if phase is Phase.DECODE else [3, 2]
    c = _state_case(phase, q_lens, 7)
    first = int(c.batch.kv_indices[0])  # request 0's first page: every row of it reads key 0
    c.k[first, 0, 0, 0] = float("nan")
    out, lse = c.run(c.q, c.k, c.v, c.backend.plan(c.batch), 0.2, return_lse=True)
    rows0 = q_lens[0]
    assert lse[:rows0, :2].isnan().all() and out[:rows0, :2].isnan().all()  # kv head 0
    assert torch.isfinite(lse[:rows0, 2:]).all() and torch.isfinite(lse[rows0:]).all()


def _split_keys(
    phase: Phase, q_lens: list[int], tables: list[list[int]], kv_lens: list[int], cut: int
) -> tuple[AttnBatch, AttnBatch, AttnBatch]:
    """The batch over every key, and two batches over the first ``cut`` pages of each table
    and the rest: disjoint key sets whose union is the first batch's."""

    def build(lens: list[int], pages: list[list[int]]) -> AttnBatch:
        return AttnBatch.build(phase, q_lens=q_lens, kv_lens=lens, page_tables=pages,
                               page_size=4, num_pages=16, device=DEVICE)  # fmt: skip

    head = [min(n, 4 * cut) for n in kv_lens]
    return (
        build(kv_lens, tables),
        build(head, [t[:cut] for t in tables]),
        build([n - h for n, h in zip(kv_lens, head, strict=True)], [t[cut:] for t in tables]),
    )


@pytest.mark.parametrize(
    ("kind", "phase", "sinks", "fp8"),
    [
        ("mha", Phase.DECODE, True, None),
        ("mla", Phase.DECODE, False, None),
        ("mha", Phase.PREFILL, True, None),  # non-causal: every query sees both halves
        ("mla", Phase.PREFILL, False, "float8_e5m2"),
    ],
)
def test_merge_of_two_key_halves_equals_the_union(
    kind: str, phase: Phase, sinks: bool, fp8: str | None
) -> None:
    # Decode (the query sees all its keys) or non-causal prefill: attention over the first
    # pages and over the rest, merged by lse, is attention over all of them. The sinks go to
    # one part only (the other gets -inf: no sink).
    hkv, d, dv = (2, 32, 32) if kind == "mha" else (1, 80, 64)
    cfg = AttnConfig(kind, 4, hkv, d, dv, dtype="float32", kv_dtype=fp8, page_size=4,  # type: ignore[arg-type]
                     device=DEVICE, sinks=sinks, causal=phase is Phase.DECODE)  # fmt: skip
    backend = TritonBackend(cfg, num_kv_splits=2)
    run = backend.handler(phase)
    q_lens = [1, 1] if phase is Phase.DECODE else [3, 2]
    tables = [[3, 7, 1, 12, 5], [9, 0, 14]]
    full, part_a, part_b = _split_keys(phase, q_lens, tables, [19, 11], 2)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(sum(q_lens), 4, d, generator=g).to(DEVICE)
    shape = (16, 4, d) if kind == "mla" else (16, 4, hkv, d)
    k = (torch.randn(shape, generator=g) * 2).to(FP8[fp8] if fp8 else torch.float32).to(DEVICE)
    v = None if kind == "mla" else torch.randn(16, 4, hkv, dv, generator=g).to(DEVICE)
    sink = torch.randn(4, generator=g).to(DEVICE)
    extra: dict[str, Any] = {"k_scale": 0.5} if fp8 else {}
    with_sink = {"sinks": sink} if sinks else {}
    no_sink = {"sinks": torch.full_like(sink, float("-inf"))} if sinks else {}
    out, lse = run(q, k, v, backend.plan(full), 0.3, return_lse=True, **extra, **with_sink)
    out_a, lse_a = run(q, k, v, backend.plan(part_a), 0.3, return_lse=True, **extra, **with_sink)
    out_b, lse_b = run(q, k, v, backend.plan(part_b), 0.3, return_lse=True, **extra, **no_sink)
    merged, merged_lse = merge_state(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_a, out, atol=1e-3)  # each half alone is another result


def test_idle_forward_with_lse_returns_empty_state() -> None:
    backend, run = _state_backend()
    batch = AttnBatch.build(Phase.DECODE, q_lens=[], kv_lens=[], page_tables=[], page_size=4)
    q = torch.randn(0, 4, 32, device=DEVICE)
    k = torch.randn(2, 4, 2, 32, device=DEVICE)
    out, lse = run(q, k, k, backend.plan(batch), 0.2, return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4) and lse.dtype == torch.float32


# ---------------------------------------------------------------- planning


def test_plan_owns_private_copies_and_scratch_is_per_call() -> None:
    cfg = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=16, device=DEVICE)
    backend = TritonBackend(cfg, num_kv_splits=3)
    batch, _ = make_batch(Phase.DECODE, [1, 1], [30, 70], 16)
    plan = backend.plan(batch)
    assert isinstance(plan, _ops.TritonPlan) and plan.kernel == "decode"
    record = backend._plans.get(plan, backend)  # the private record the launches read
    assert isinstance(record, _ops.DecodePlan)
    assert record.snap.kv_indices.data_ptr() != batch.kv_indices.data_ptr()
    before = record.snap.kv_indices.clone()
    batch.kv_indices.fill_(-1)  # an edit after planning never reaches the kernels
    assert torch.equal(record.snap.kv_indices, before)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_splits = 1  # type: ignore[misc]
    # The handle holds no tensor, and no scratch lives in the record: threads sharing a
    # plan share no buffer.
    for held in (plan, record):
        fields = dataclasses.fields(held)
        assert not any(isinstance(getattr(held, f.name), torch.Tensor) for f in fields)
    assert not hasattr(plan, "snap") and not hasattr(plan, "owner")


def test_choose_num_splits_rule() -> None:
    # Enough (request, head group) programs already: no split.
    assert choose_num_splits(512, 8, 4096, target_programs=264, min_split_tokens=256,
                             max_splits=32) == 1  # fmt: skip
    # MLA batch 64, one head group, H200-like target: ceil(264 / 64) = 5.
    assert choose_num_splits(64, 1, 4096, target_programs=264, min_split_tokens=256,
                             max_splits=32) == 5  # fmt: skip
    # Short sequences cap the split count: 600 tokens / 256 -> 3.
    assert choose_num_splits(1, 1, 600, target_programs=264, min_split_tokens=256,
                             max_splits=32) == 3  # fmt: skip
    assert choose_num_splits(1, 1, 10**6, target_programs=264, min_split_tokens=256,
                             max_splits=32) == 32  # fmt: skip


def test_dim_layout_rule() -> None:
    assert DimLayout.of(576, 512) == DimLayout(576, 512, 512, 64, 512)
    assert DimLayout.of(80, 64) == DimLayout(80, 64, 64, 16, 64)
    assert DimLayout.of(72, 40) == DimLayout(72, 40, 64, 16, 64)
    assert DimLayout.of(128, 128).rest == 0
    assert dim_reasons(128, 128) == []
    assert any("head_dim 8" in r for r in dim_reasons(8, 128))
    assert any("v_head_dim 2048" in r for r in dim_reasons(128, 2048))


# ---------------------------------------------------------------- capabilities


def test_capabilities_name_the_problem() -> None:
    ok = AttnConfig("mha", 8, 2, 128, 128, dtype="bfloat16", device=DEVICE)
    assert CAPABILITIES.reasons(ok, Phase.VERIFY) == []
    tiny = ok.replace(head_dim=8, v_head_dim=8)
    assert any("head_dim 8" in r for r in CAPABILITIES.reasons(tiny, Phase.DECODE))
    mixed = ok.replace(kv_dtype="float16")
    assert any("kv_dtype 'float16'" in r for r in CAPABILITIES.reasons(mixed, Phase.DECODE))


def test_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AttnConfig("mha", 8, 2, 128, 128, dtype="float32", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert CAPABILITIES.reasons(cfg, Phase.DECODE) == []
    monkeypatch.delenv("TRITON_INTERPRET")
    reasons = CAPABILITIES.reasons(cfg, Phase.DECODE)
    assert any("TRITON_INTERPRET=1" in r for r in reasons), reasons


def test_interpreter_switched_on_after_triton_was_imported_is_a_bind_reason() -> None:
    # triton fixes "interpreted or compiled" per @jit function when it is defined: switched on
    # after triton.language was imported, its own helpers stay compiled and the kernels would
    # crash inside the interpreter. Bind says so instead (own process: import order matters).
    code = (
        "import os, sys\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from attn_dispatch import AttnConfig, BackendSpec, bind\n"
        "from attn_dispatch._errors import AttnDispatchError\n"
        "cfg = AttnConfig('mha', 4, 2, 32, 32, dtype='float32', device='cpu')\n"
        "try:\n"
        "    bind(BackendSpec.uniform('triton'), cfg)\n"
        "except AttnDispatchError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "before anything imports triton" in done.stdout, done.stdout


def test_bad_options_raise() -> None:
    cfg = AttnConfig("mha", 8, 2, 64, 64, dtype="float32", device=DEVICE)
    with pytest.raises(InvalidSpecError, match="unknown triton backend options"):
        TritonBackend(cfg, splits=2)
    with pytest.raises(InvalidSpecError, match="power of two"):
        TritonBackend(cfg, decode_block_n=24)
    with pytest.raises(ValueError, match="positive int"):
        TritonBackend(cfg, num_kv_splits=0)


def test_graphed_decode_keeps_its_split_count_as_sequences_grow() -> None:
    # A captured graph baked in the split count of the capture step. Later steps whose
    # sequences grew past a split-rule threshold would plan another count; update_plan keeps
    # the captured one (valid for any lengths) instead of refusing the step.
    from attn_dispatch.cuda_graph import capture_decode

    cfg = AttnConfig("mha", 4, 2, 32, 32, dtype="float32", page_size=16, device=DEVICE)
    opts = {"triton": {"target_programs": 8, "min_split_tokens": 32}}
    binding = bind("triton", cfg, label="target", options=opts)
    tables = [[0, 2, 4, 6], [1, 3, 5, 7]]  # four pages each: room to grow, same shapes

    def step_batch(lens: list[int]) -> AttnBatch:
        return AttnBatch.build(
            Phase.DECODE, q_lens=[1, 1], kv_lens=lens, page_tables=tables, page_size=16,
            num_pages=8, device=DEVICE,
        )  # fmt: skip

    k_cache = torch.randn(8, 16, 2, 32, device=DEVICE)
    v_cache = torch.randn(8, 16, 2, 32, device=DEVICE)
    q = torch.randn(2, 4, 32, device=DEVICE)

    def step(q: torch.Tensor) -> torch.Tensor:
        return attention(q, k_cache, v_cache, sm_scale=0.2)

    first = step_batch([20, 30])
    graphed = capture_decode(binding, first, step, q)
    assert graphed.plan.num_splits == 1
    grown = step_batch([60, 62])
    assert binding.backend(Phase.DECODE).plan(grown).num_splits == 2  # what a fresh plan picks
    q2 = torch.randn(2, 4, 32, device=DEVICE)
    out = graphed.replay(grown, q2).clone()
    ref = reference(q2, k_cache, v_cache, grown, 0.2, 32)
    torch.testing.assert_close(out.cpu(), ref, atol=TOL["float32"], rtol=TOL["float32"])


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_decode_replays_in_a_cuda_graph() -> None:
    # Capture one layer's decode with the forward's plan, then change the lengths on the
    # device (as a serving loop does between steps) and replay: the graph must follow them.
    cfg = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=16, device="cuda")
    backend = TritonBackend(cfg, num_kv_splits=4)
    batch, pages = make_batch(Phase.DECODE, [1, 1, 1], [200, 64, 130], 16)
    q = torch.randn(3, 16, 576, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(pages, 16, 576, device="cuda", dtype=torch.bfloat16)
    run = backend.handler(Phase.DECODE)
    plan = backend.plan(batch)
    run(q, k_cache, None, plan, 0.05)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(q, k_cache, None, plan, 0.05)
    # Same page tables, shorter sequences: re-plan into the captured buffers, then replay.
    shorter_batch = AttnBatch(
        Phase.DECODE, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
        torch.tensor([150, 40, 129], dtype=torch.int32, device="cuda"), page_size=16,
    )  # fmt: skip
    backend.update_plan(plan, shorter_batch)
    graph.replay()
    torch.cuda.synchronize()
    # Same page tables, shorter sequences: what the replay should have computed.
    shorter = SimpleNamespace(
        num_requests=3,
        qo_indptr_host=batch.qo_indptr_host,
        kv_indptr_host=batch.kv_indptr_host,
        kv_indices=batch.kv_indices,
        kv_lens_host=torch.tensor([150, 40, 129], dtype=torch.int32),
        custom_mask=None,
    )
    ref = reference(q, k_cache, None, shorter, 0.05, 512)
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL["bfloat16"], rtol=TOL["bfloat16"])


# ---------------------------------------------------------------- GPU compilation, no GPU


def test_kernels_compile_for_sm90() -> None:
    # The interpreter never runs triton's compiler: lower and assemble the kernels for sm90
    # with the launch constants the backend uses on CUDA (tests/backends/triton/aot.py, own process
    # because TRITON_INTERPRET is read when the kernels are defined).
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton build cannot compile for CUDA ahead of time: {exc}")
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "tests.backends.triton.aot", "90"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == 15, done.stdout


def test_upcast_switch_is_on_only_when_interpreting() -> None:
    # The interpreter multiplies bf16 bit patterns as integers: every load is upcast to fp32
    # there (the bf16 cases above check the numbers); compiled GPU kernels keep bf16 tiles.
    cfg = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16")
    on_cpu = kernel_config(cfg, {}, device=torch.device("cpu"), num_sms=None, interpreting=True)
    on_gpu = kernel_config(cfg, {}, device=torch.device("cuda"), num_sms=132, interpreting=False)
    assert on_cpu.upcast and _ops.decode_constants(on_cpu)["M"].UPCAST is True
    assert not on_gpu.upcast and _ops.extend_constants(on_gpu, True)["M"].UPCAST is False
    if DEVICE == "cpu":
        assert TritonBackend(cfg.replace(device="cpu")).kernel_config.upcast
