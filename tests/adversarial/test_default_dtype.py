"""Every CPU backend computes in its own dtypes whatever torch's default dtype is.

A process may run with ``torch.set_default_dtype(torch.float64)`` (scientific code) or
bfloat16; a backend that allocates a float buffer without ``dtype=`` then computes in that
dtype, or fails (einsum refuses mixed dtypes). Each backend that runs here serves the same
MHA prefill (window, cap, sinks), MLA decode and FP8 decode, with lse, under each default
dtype, and must match the float64 oracle at the float32 tolerance, in the config's dtypes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import list_backends
from tests.contract.cases import lse_tolerance
from tests.contract.cases import materialise
from tests.contract.cases import naive_state
from tests.contract.cases import tolerance
from tests.strategies import KernelCase

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["torch", "native", "triton"]


def _case(**over: object) -> KernelCase:
    base: dict[str, object] = dict(
        kind="mha", phase=Phase.PREFILL, num_q_heads=4, num_kv_heads=2, head_dim=16,
        v_head_dim=16, page_size=4, dtype="float32", q_lens=(3, 2), prefix_lens=(6, 3),
        trees=None, extra_pages=2, seed=11, lse=True,
    )  # fmt: skip
    base.update(over)
    return KernelCase(**base)  # type: ignore[arg-type]


CASES = {
    "mha-prefill-variants": _case(window_left=4, logit_cap=5.0, sinks=True),
    "mla-decode": _case(
        kind="mla",
        num_kv_heads=1,
        head_dim=32,
        v_head_dim=16,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(9, 4),
    ),
    "fp8-decode": _case(
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(7, 12),
        kv_dtype="float8_e5m2",
        k_scale=0.5,
        v_scale=2.0,
    ),
}


@pytest.fixture(params=[torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    """torch's default dtype set for the test, restored after it whatever happens."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_ignores_the_default_dtype(
    backend: str, name: str, default_dtype: torch.dtype
) -> None:
    caps = list_backends().get(backend)
    if caps is None or caps.availability_reasons():
        pytest.skip(f"backend {backend!r} cannot run here")
    case = CASES[name]
    m = materialise(case)
    if caps.reasons(m.config, case.phase):
        pytest.skip(f"{backend} does not serve {name}: {caps.reasons(m.config, case.phase)}")
    assert torch.get_default_dtype() is default_dtype
    binding = bind(backend, m.config, label=f"default-{default_dtype}")
    extras: Any = m.extras()
    with attn_scope(binding, m.batch):
        out, lse = attention(
            m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, return_lse=True, **extras
        )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    want_out, want_lse = naive_state(m)
    atol, rtol = tolerance(case.dtype)
    if case.kv_dtype is not None:
        atol, rtol = max(atol, 3e-2), max(rtol, 3e-2)
    torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=rtol)
    atol, rtol = lse_tolerance(case.dtype)
    torch.testing.assert_close(lse.double(), want_lse, atol=atol, rtol=rtol)


def test_fixture_restores_the_default_dtype() -> None:
    # Runs after the parametrised tests above in this module: they left the default alone.
    assert torch.get_default_dtype() is torch.float32
