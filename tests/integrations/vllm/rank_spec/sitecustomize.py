"""Test-only: one tensor-parallel rank of a vLLM engine binds another target spec.

The engine test that shows a disagreement between ranks is caught at start-up puts this
directory first on ``PYTHONPATH`` with ``TEST_RANK_SPEC="<tp rank>:<spec>"``: Python imports
this module at start in the test's process and in each vLLM worker it spawns, and it wraps
the plugin's ``settings_of`` (before the plugin's modules import it) so that the layers of
that rank read ``<spec>`` as the target's. Nothing here is part of attn_dispatch.
"""

from __future__ import annotations

import os
from typing import Any


def _install(raw: str) -> None:
    import dataclasses

    from attn_dispatch import BackendSpec
    from attn_dispatch.integrations.vllm import _settings

    rank, _, spec = raw.partition(":")
    original = _settings.settings_of

    def settings_of(vllm_config: Any) -> Any:
        settings = original(vllm_config)
        if settings is None:
            return None
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return settings
        if parallel_state.get_tp_group().rank_in_group != int(rank):
            return settings
        return dataclasses.replace(settings, target=BackendSpec.parse(spec))

    _settings.settings_of = settings_of


if os.environ.get("TEST_RANK_SPEC"):
    _install(os.environ["TEST_RANK_SPEC"])
