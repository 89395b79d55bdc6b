"""What a backend must provide. No torch here: tensors are typed as ``Any``."""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from attn_dispatch._phase import Phase

if TYPE_CHECKING:
    from attn_dispatch._binding import Binding


class Handler(Protocol):
    """One phase's kernel: ``handler(q, k_cache, v_cache, plan, sm_scale) -> out``.

    ``plan`` is what the same backend's ``plan(batch)`` returned for this forward. The handler
    runs once per layer: it must not plan again, allocate per-layer metadata or sync the host.
    """

    def __call__(
        self, q: Any, k_cache: Any, v_cache: Any, plan: Any, sm_scale: float, /
    ) -> Any: ...


@runtime_checkable
class AttentionBackend(Protocol):
    """A backend object, built by a registered factory at ``bind`` (one per runner and name).

    ``plan(batch)`` runs once per forward, on the host, before the layers; ``handler(phase)``
    runs once per phase at bind and returns the per-layer callable.
    """

    name: str

    def plan(self, batch: Any) -> Any: ...

    def handler(self, phase: Phase) -> Handler: ...


@runtime_checkable
class Runner(Protocol):
    """Anything that owns a ``Binding``: a model runner, a draft worker, a wrapper."""

    @property
    def attn_binding(self) -> Binding: ...
