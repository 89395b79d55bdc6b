"""Fixtures of the vLLM tests: the tiny models, one place (``engines.Models``); the engine
set-up the children share is ``engines.py``."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.engines import Models


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The engine tests' tiny random models, each saved once per session when first asked
    for: ``models["llama"]`` is its directory (``engines.Models`` lists them)."""
    return Models(tmp_path_factory.mktemp("vllm_models"))
