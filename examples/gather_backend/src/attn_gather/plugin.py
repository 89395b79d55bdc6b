"""The entry point: what the backend serves, and where its factory lives.

Kept light (no torch): attn_dispatch imports this module the first time a registry is used,
and checks ``CAPABILITIES`` at ``bind`` before it imports ``attn_gather.backend``.
"""

from __future__ import annotations

from attn_dispatch import Phase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import Registry

NAME = "gather"

CAPABILITIES = Capabilities(
    kinds={"mha"},
    phases=set(Phase),
    devices={"cpu"},
    dtypes={"float32", "bfloat16"},
    custom_mask=True,  # tree verify: the per-request mask goes to SDPA as attn_mask
    out_buffer=True,  # the handler takes out= and writes the result there
    requires=("torch",),
    description="example plugin: pages gathered per request, torch SDPA (causal, trees)",
)


def register(registry: Registry) -> None:
    """Called once by each registry that loads the entry point, with that registry."""
    registry.register(NAME, capabilities=CAPABILITIES, factory="attn_gather.backend:GatherBackend")
