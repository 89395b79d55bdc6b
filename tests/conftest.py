"""Shared test set-up: hypothesis profiles and a registry snapshot fixture.

Profiles (select with HYPOTHESIS_PROFILE, default "ci"):
  ci        200 examples per property (the isolation state machine included), no deadline
  thorough  5000 examples per property
  dev       20 examples, for quick local iteration
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck
from hypothesis import settings

from tests.strategies import RegistrySnapshot

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=200, stateful_step_count=25, **_COMMON)
settings.register_profile("thorough", max_examples=5000, stateful_step_count=40, **_COMMON)
settings.register_profile("dev", max_examples=20, stateful_step_count=15, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# triton reads TRITON_INTERPRET when a @triton.jit function is *defined*. Some test modules
# (torch.compile's) import triton's helpers before the triton tests would switch the
# interpreter on, so on a machine without CUDA switch it on here, before any test module loads.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def registry_snapshot() -> Iterator[RegistrySnapshot]:
    """Any backend a test registers (or removes) is undone after it."""
    snap = RegistrySnapshot()
    try:
        yield snap
    finally:
        snap.restore()
