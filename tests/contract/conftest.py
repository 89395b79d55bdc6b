"""The repository's contract tests are the contract kit (``attn_dispatch.testing.contract``)
run over every built-in backend: this conftest parametrises the kit's ``attn_backend`` and
overrides its ``attn_contract_profile``.

A built-in joins by adding its name to BACKENDS (and a PROFILES entry if it needs smaller
shapes or fewer examples). A backend that cannot run on this machine (not installed, no
CUDA, not built) skips with its own reasons. ``--attn-backend NAME`` narrows the run to
those names.
"""

from __future__ import annotations

import os

import pytest
import torch

from attn_dispatch.testing.contract.cases import DEFAULT_LIMITS
from attn_dispatch.testing.contract.cases import Limits
from attn_dispatch.testing.contract.harness import ContractProfile
from attn_dispatch.testing.plugin import backend_names

# The triton backend runs on CPU only under triton's interpreter, which triton reads when the
# kernels are defined (first bind): switch it on before any test binds it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["torch", "native", "flashinfer", "triton", "sdpa"]

#: The repository's own runs draw more than the kit's defaults (a plugin's CI run): five
#: times its examples, which keeps the contract module under a sixth of the suite's time on a
#: 2-core machine (``HYPOTHESIS_PROFILE=thorough`` draws ten times as many).
FULL = ContractProfile(
    DEFAULT_LIMITS, examples=50, variant_examples=30, lse_examples=20, out_examples=15
)
PROFILES: dict[str, ContractProfile] = {
    # FlashInfer: 16-bit only; MLA latent % 128 and rope % 64 (576/512, 192/128).
    "flashinfer": ContractProfile(
        limits=Limits(
            mla_dims=((576, 512), (192, 128)),
            dtypes=("bfloat16", "float16"),
            mla_trees=False,
        ),
        examples=50,
        variant_examples=30,
        lse_examples=20,
        out_examples=15,
    ),
    # The interpreter costs tens of ms per program instance: tiny shapes keep each launch
    # under ~64 programs (batch x heads x query blocks, or batch x head groups x kv splits).
    # Fewer examples: on CPU each one runs in the interpreter, on CUDA a new shape may
    # JIT-compile new kernel variants (seconds each).
    "triton": ContractProfile(
        limits=Limits(
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
        examples=20,
        variant_examples=20,
        lse_examples=20,
    ),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every built-in, unless ``--attn-backend`` names the ones to run (the plugin then
    parametrises ``attn_backend`` with those)."""
    if "attn_backend" in metafunc.fixturenames and not backend_names(metafunc.config):
        metafunc.parametrize("attn_backend", BACKENDS)


@pytest.fixture
def attn_contract_profile(attn_backend: str) -> ContractProfile:
    return PROFILES.get(attn_backend, FULL)
