"""Fixtures of the transformers integration tests: quiet, one thread, and a second name for
the reference kernels. The tiny models themselves are built in ``tiny.py`` (importable at
collection time, for parametrize)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _quiet_one_thread() -> Iterator[None]:
    """One torch thread (tiny models run faster and the same every time) and transformers'
    warnings off, restored afterwards."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture
def torch2() -> Iterator[str]:
    """The reference kernels registered under a second name, so two runners' choices differ."""
    from attn_dispatch.backend import register_backend
    from attn_dispatch.backend import unregister_backend
    from attn_dispatch.backends.reference import CAPABILITIES

    register_backend(
        "torch2",
        capabilities=CAPABILITIES,
        factory="attn_dispatch.backends.reference.backend:TorchBackend",
        replace=True,
    )
    yield "torch2"
    unregister_backend("torch2")
