"""The kernel contract: every backend, every phase and kind, against the naive reference.

A backend joins by adding its name to BACKENDS (and, if it needs smaller shapes, a Limits
entry). A backend that cannot run on this machine (not installed, no CUDA, not built) skips
with its own reasons; a case its declared capabilities refuse fails, so LIMITS must describe
what the backend really supports.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings

from attn_dispatch import AttnBatch
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import list_backends
from tests.contract.cases import Materialised
from tests.contract.cases import assert_lse_matches
from tests.contract.cases import config_of
from tests.contract.cases import materialise
from tests.contract.cases import naive_attention
from tests.contract.cases import naive_state
from tests.contract.cases import tolerance
from tests.strategies import DEFAULT_LIMITS
from tests.strategies import KernelCase
from tests.strategies import Limits
from tests.strategies import Served
from tests.strategies import kernel_cases
from tests.strategies import variant_cases

# The triton backend runs on CPU only under triton's interpreter, which triton reads when the
# kernels are defined (first bind): switch it on before any test binds it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["torch", "native", "flashinfer", "triton", "sdpa"]
LIMITS: dict[str, Limits] = {
    "torch": DEFAULT_LIMITS,
    "native": DEFAULT_LIMITS,
    "sdpa": DEFAULT_LIMITS,
    # FlashInfer: 16-bit only; MLA latent % 128 and rope % 64 (576/512, 192/128).
    "flashinfer": Limits(
        mla_dims=((576, 512), (192, 128)),
        dtypes=("bfloat16", "float16"),
        mla_trees=False,
    ),
    # The interpreter costs tens of ms per program instance: tiny shapes keep each launch
    # under ~64 programs (batch x heads x query blocks, or batch x head groups x kv splits).
    "triton": Limits(
        max_requests=2,
        max_q=20,
        max_prefix=60,
        page_sizes=(1, 16),
        gqa_ratios=(1, 2, 4),
        max_kv_heads=2,
        # Few widths: on CUDA each one compiles its own kernels (96 = 64 + 32 is covered
        # in tests/backends/triton/test_backend.py).
        mha_dims=((64, 64), (192, 128)),
        mla_dims=((576, 512), (80, 64)),
        mla_heads=(1, 2, 16),
    ),
}
CUDA_ONLY = {"flashinfer"}

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
EXAMPLES = 500 if THOROUGH else 100
# Fewer examples for triton: on CPU each one runs in the interpreter, on CUDA a new shape
# may JIT-compile new kernel variants (seconds each).
FEW_EXAMPLES = {"triton"}
FEW = 100 if THOROUGH else 20
# The variant cases draw on top of the plain ones, which the other tests cover already.
VARIANT_EXAMPLES = 300 if THOROUGH else 50


def device_for(backend: str) -> str:
    if backend in CUDA_ONLY or (torch.cuda.is_available() and backend != "native"):
        return "cuda"
    return "cpu"


def skip_if_unavailable(backend: str) -> None:
    caps = list_backends().get(backend)
    if caps is None:
        pytest.skip(f"backend {backend!r} is not registered in this install")
    why = caps.availability_reasons()
    if why:
        pytest.skip(f"backend {backend!r} cannot run here: {'; '.join(why)}")


def skip_if_refused(backend: str, case: KernelCase) -> None:
    """Fixed edge cases outside a backend's declared capabilities skip, naming the reasons
    (the hypothesis cases come from LIMITS and must all be served)."""
    why = list_backends()[backend].reasons(config_of(case, device_for(backend)), case.phase)
    if why:
        pytest.skip(f"outside {backend!r}'s declared capabilities: {'; '.join(why)}")


def run_case(backend: str, case: KernelCase) -> tuple[Any, Materialised]:
    """``attention`` on the case: ``out``, or ``(out, lse)`` for a case with ``lse``."""
    m = materialise(case, device_for(backend))
    binding = bind(backend, m.config, label=f"contract-{backend}")
    kw = m.extras()
    if case.lse:
        kw["return_lse"] = True
    with attn_scope(binding, m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **kw)
    return out, m


def check_against_naive(backend: str, case: KernelCase) -> None:
    result, m = run_case(backend, case)
    out, lse = result if case.lse else (result, None)
    assert out.dtype == m.q.dtype
    assert out.shape == (sum(case.q_lens), case.num_q_heads, case.v_head_dim)
    ref, ref_lse = naive_state(m)
    atol, rtol = tolerance(case.dtype)
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    if lse is not None:
        assert_lse_matches(lse, m, ref_lse)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_naive_reference(backend: str, kind: str, phase: Phase) -> None:
    skip_if_unavailable(backend)
    limits = LIMITS.get(backend, DEFAULT_LIMITS)

    @settings(
        max_examples=FEW if backend in FEW_EXAMPLES else EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=kernel_cases(kind=kind, phase=phase, limits=limits))
    def check(case: KernelCase) -> None:
        check_against_naive(backend, case)

    check()


FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def served(backend: str, kind: str, phase: Phase) -> tuple[Served, list[str]]:
    """What ``backend`` declares of the variants and FP8 formats for (kind, phase), probed
    one at a time on a small config of that kind; and the reasons for what it refuses."""
    limits = LIMITS.get(backend, DEFAULT_LIMITS)
    if kind == "mla":
        hd, dv = limits.mla_dims[0]
        dims = dict(num_q_heads=limits.mla_heads[-1], num_kv_heads=1, head_dim=hd, v_head_dim=dv)
    else:
        hd, dv = limits.mha_dims[0]
        dims = dict(num_q_heads=2, num_kv_heads=1, head_dim=hd, v_head_dim=dv)
    base = _case(
        kind=kind, phase=phase, page_size=limits.page_sizes[0], dtype=limits.dtypes[-1], **dims
    )
    caps = list_backends()[backend]
    probes: dict[str, dict[str, object]] = {
        "window": dict(window_left=4),
        "logit_cap": dict(logit_cap=5.0),
        "sinks": dict(sinks=True),
        "non_causal": dict(causal=False),
        "chunked": dict(chunk=8),
        "lse": dict(lse=True),
        **{f: dict(kv_dtype=f) for f in FP8_FORMATS},
    }
    ok: list[str] = []
    why: list[str] = []
    for name, over in probes.items():
        cfg = config_of(dataclasses.replace(base, **over), device_for(backend))  # type: ignore[arg-type]
        found = caps.config_reasons(cfg, phase)
        (why.extend(found) if found else ok.append(name))
    return Served(
        variants=frozenset(ok) & {"window", "logit_cap", "sinks", "non_causal", "chunked", "lse"},
        fp8=tuple(f for f in FP8_FORMATS if f in ok),
    ), why


def _case(**over: object) -> KernelCase:
    base: dict[str, object] = dict(
        kind="mha",
        phase=Phase.PREFILL,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        v_head_dim=64,
        page_size=16,
        dtype="float32",
        q_lens=(3,),
        prefix_lens=(13,),
        trees=None,
        extra_pages=2,
        seed=7,
    )
    base.update(over)
    return KernelCase(**base)  # type: ignore[arg-type]


EDGE_CASES = {
    "one-full-page-decode": _case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(15,)),
    "one-full-page-prefill": _case(q_lens=(16,), prefix_lens=(0,)),
    "partial-last-page": _case(q_lens=(5, 2), prefix_lens=(30, 1)),
    "mla-partial-page": _case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(20, 47),
    ),
    "verify-tree": _case(phase=Phase.VERIFY, q_lens=(4,), prefix_lens=(9,), trees=((-1, 0, 0, 1),)),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_cases(backend: str, name: str) -> None:
    skip_if_unavailable(backend)
    skip_if_refused(backend, EDGE_CASES[name])
    check_against_naive(backend, EDGE_CASES[name])


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_single_chain_tree_equals_causal(backend: str, kind: str) -> None:
    skip_if_unavailable(backend)
    dims = dict(num_q_heads=2, num_kv_heads=1, head_dim=80, v_head_dim=64) if kind == "mla" else {}
    chain = _case(
        kind=kind,
        phase=Phase.VERIFY,
        q_lens=(5,),
        prefix_lens=(11,),
        trees=((-1, 0, 1, 2, 3),),
        **dims,
    )
    causal = _case(
        kind=kind, phase=Phase.VERIFY, q_lens=(5,), prefix_lens=(11,), trees=None, **dims
    )
    skip_if_refused(backend, chain)
    out_tree, _ = run_case(backend, chain)
    out_causal, _ = run_case(backend, causal)
    atol, rtol = tolerance("float32")
    torch.testing.assert_close(out_tree, out_causal, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_untouched_and_deterministic(backend: str, dtype: str) -> None:
    skip_if_unavailable(backend)
    case = _case(dtype=dtype, phase=Phase.VERIFY, q_lens=(3, 2), prefix_lens=(17, 4))
    skip_if_refused(backend, case)
    m = materialise(case, device_for(backend))
    before = [t.clone() for t in (m.q, m.k_cache, m.v_cache)]  # type: ignore[union-attr]
    binding = bind(backend, m.config)
    with attn_scope(binding, m.batch):
        a = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
        b = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    assert a.dtype == m.q.dtype
    assert torch.equal(a, b)
    for old, new in zip(before, (m.q, m.k_cache, m.v_cache), strict=True):
        assert torch.equal(old, new)  # bit-identical after the call


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_checks(backend: str) -> None:
    skip_if_unavailable(backend)
    case = _case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(5,), dtype="bfloat16")
    skip_if_refused(backend, case)
    m = materialise(case, device_for(backend))
    binding = bind(backend, m.config)
    with attn_scope(binding, m.batch):
        with pytest.raises(InvalidBatchError, match="q") as err:
            attention(m.q[:, :3], m.k_cache, m.v_cache, sm_scale=m.sm_scale)  # wrong head count
        assert err.value.field == "q"
        with pytest.raises(InvalidBatchError, match="dtype"):
            attention(m.q.float(), m.k_cache, m.v_cache, sm_scale=m.sm_scale)
        with pytest.raises(InvalidBatchError, match="k_cache"):
            attention(m.q, m.k_cache[..., :32], m.v_cache, sm_scale=m.sm_scale)  # wrong width
        with pytest.raises(InvalidBatchError):
            attention(m.q, m.k_cache, None, sm_scale=m.sm_scale)  # MHA needs a v_cache


def test_config_of_marks_tree_verify() -> None:
    case = _case(phase=Phase.VERIFY, trees=((-1, 0, 1),))
    assert config_of(case).tree_verify
    assert isinstance(materialise(case).batch, AttnBatch)


def test_reference_long_context_is_chunked() -> None:
    """A 32k-token decode: the reference never holds more than one chunk of scores."""
    from attn_dispatch.backends.reference import backend as ref

    case = _case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1,),
        prefix_lens=(32767,),
        page_size=64,
    )
    m = materialise(case)
    binding = bind("torch", m.config)
    plan = binding.plan(m.batch)
    assert plan.chunk_pages * case.page_size == ref.CHUNK_TOKENS < 32768
    seen: list[int] = []
    real_update = ref._OnlineSoftmax.update

    def spy(
        self: object, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, s: float
    ) -> None:
        seen.append(k.shape[-2])
        real_update(self, k, v, allowed, s)  # type: ignore[arg-type]

    ref._OnlineSoftmax.update = spy  # type: ignore[method-assign]
    try:
        check_against_naive("torch", case)
    finally:
        ref._OnlineSoftmax.update = real_update  # type: ignore[method-assign]
    assert len(seen) == 16 and max(seen) == ref.CHUNK_TOKENS


# -- layer variants and FP8 caches --------------------------------------------------------------


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_match_naive_reference(backend: str, kind: str, phase: Phase) -> None:
    """Windows (0, small, beyond the context), caps, sinks and FP8 caches (both formats,
    scales other than 1), alone and together, for what each backend declares."""
    skip_if_unavailable(backend)
    serves, why = served(backend, kind, phase)
    if not serves.variants and not serves.fp8:
        pytest.skip(f"{backend!r} declares no variant or FP8 cache here: {'; '.join(why)}")
    limits = LIMITS.get(backend, DEFAULT_LIMITS)

    @settings(
        max_examples=FEW if backend in FEW_EXAMPLES else VARIANT_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=variant_cases(kind=kind, phase=phase, served=serves, limits=limits))
    def check(case: KernelCase) -> None:
        check_against_naive(backend, case)

    check()


VARIANT_EDGES = {
    # attention types (issue 27): non-causal (encoders) and chunked local attention (Llama 4)
    "non-causal-prefill": _case(q_lens=(6, 2), prefix_lens=(10, 0), causal=False),
    "non-causal-decode": _case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(40, 3), causal=False
    ),
    "non-causal-tree": _case(
        phase=Phase.VERIFY, q_lens=(4,), prefix_lens=(9,), trees=((-1, 0, 0, 1),), causal=False
    ),
    "non-causal-cap-sinks-fp8": _case(
        q_lens=(5,),
        prefix_lens=(20,),
        causal=False,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e4m3fn",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "chunk-prefill-crosses-chunks": _case(q_lens=(20, 3), prefix_lens=(9, 30), chunk=8),
    "chunk-decode-skips-pages": _case(
        phase=Phase.DECODE, q_lens=(1, 1, 1), prefix_lens=(300, 63, 64), chunk=64
    ),
    "chunk-1": _case(q_lens=(4,), prefix_lens=(5,), chunk=1),
    "chunk-tree": _case(
        phase=Phase.VERIFY, q_lens=(5,), prefix_lens=(6,), trees=((-1, 0, 1, 0, 3),), chunk=4
    ),
    "chunk-window-cap-sinks-fp8": _case(
        q_lens=(12, 1),
        prefix_lens=(21, 40),
        chunk=8,
        window_left=5,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e5m2",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "chunk-mla-decode": _case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(70, 5),
        chunk=16,
    ),
    "window-0-prefill": _case(q_lens=(5,), prefix_lens=(20,), window_left=0),
    "window-beyond-context": _case(q_lens=(3, 1), prefix_lens=(40, 2), window_left=10_000),
    "window-decode-skips-pages": _case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(300, 17), window_left=31
    ),
    "window-tree": _case(
        phase=Phase.VERIFY,
        q_lens=(5,),
        prefix_lens=(9,),
        trees=((-1, 0, 0, 1, 2),),
        window_left=3,
    ),
    "cap-and-sinks": _case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(30, 0), logit_cap=1.0, sinks=True
    ),
    "fp8-e4m3-mha": _case(
        q_lens=(4,),
        prefix_lens=(25,),
        kv_dtype="float8_e4m3fn",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "fp8-e5m2-mla": _case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(20, 47),
        kv_dtype="float8_e5m2",
        k_scale=3.0,
        v_scale=3.0,
    ),
    "everything-verify": _case(
        phase=Phase.VERIFY,
        q_lens=(4, 3),
        prefix_lens=(33, 5),
        trees=((-1, 0, 1, 1), (-1, -1, 1)),
        window_left=6,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e4m3fn",
        k_scale=0.25,
        v_scale=0.5,
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANT_EDGES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_edge_cases(backend: str, name: str) -> None:
    skip_if_unavailable(backend)
    skip_if_refused(backend, VARIANT_EDGES[name])
    check_against_naive(backend, VARIANT_EDGES[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_beyond_context_equals_full(backend: str) -> None:
    skip_if_unavailable(backend)
    wide = _case(q_lens=(4, 2), prefix_lens=(50, 3), window_left=54)
    full = _case(q_lens=(4, 2), prefix_lens=(50, 3))
    skip_if_refused(backend, wide)
    a, _ = run_case(backend, wide)
    b, _ = run_case(backend, full)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_slots_outside_are_unread(backend: str) -> None:
    """Keys before a decode's window never reach the output, whatever they hold (NaN)."""
    skip_if_unavailable(backend)
    case = _case(
        phase=Phase.DECODE,
        q_lens=(1,),
        prefix_lens=(99,),
        window_left=20,
        page_size=16,
        extra_pages=0,
    )
    skip_if_refused(backend, case)
    m = materialise(case, device_for(backend))
    ref = naive_attention(m)
    table = m.page_tables[0]
    for t in range(0, 100 - 21):  # positions 0..78 are outside the window of position 99
        m.k_cache[table[t // 16], t % 16] = float("nan")
        assert m.v_cache is not None
        m.v_cache[table[t // 16], t % 16] = float("nan")
    binding = bind(backend, m.config)
    with attn_scope(binding, m.batch):
        out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-4, rtol=2e-4)
