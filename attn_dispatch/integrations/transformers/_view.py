"""What one forward of a bound model tells the functions transformers calls: the bound
model's groups (``_ModelMap``) and the forward's view (``DenseView``), held in a context
variable that ``use()``'s forward wrapper sets around the model's own forward.

The attention and mask functions are registered once, process-wide, under one name; this
context variable is how each call finds the model (a target or its assistant) and the forward
it belongs to.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import TYPE_CHECKING

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch.integrations.transformers._common import _PUBLIC_MODULE
from attn_dispatch.integrations.transformers._common import IMPLEMENTATION

if TYPE_CHECKING:
    from attn_dispatch.integrations.transformers._cache import PagedCache
    from attn_dispatch.integrations.transformers._layer import _Step


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ModelMap:
    """What the per-call functions need to know about one bound model."""

    configs: dict[str, AttnConfig]
    grouped: bool  # several groups: each layer passes group= to attention()
    window: int | None  # transformers' sliding_window (W) when some layer slides
    chunk: int | None = None  # attention_chunk_size when some layer is chunked (Llama 4)
    layers: tuple[str, ...] = ()  # each layer's group, by layer_idx

    def positional(self) -> str | None:
        """What makes the contract's positions (a request's real tokens) and transformers'
        (the row's columns) differ when padding sits inside a row: None if nothing does."""
        if self.window is not None:
            return f"a sliding window (sliding_window={self.window!r})"
        if self.chunk is not None:
            return f"chunked attention (attention_chunk_size={self.chunk!r})"
        return None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DenseView:
    """How one forward's dense tensors map onto its ``AttnBatch``."""

    batch: AttnBatch | None  # None when no row has a real query token
    batch_size: int
    q_len: int
    kv_len: int  # dense key length S (cached + new)
    q_rows: torch.Tensor  # int64: rows of the flattened [B * q_len] queries that are real
    model: _ModelMap | None = None  # the bound model's groups (None: a DenseView made by hand)
    step: _Step | None = None  # the paged cache's plan of this forward (None: dense K/V)
    cache: PagedCache | None = None
    # The mask kinds transformers asked for in this forward (a chunked layer needs "chunked":
    # its attention call itself carries no sign of the pattern the model meant).
    asked: set[str] = dataclasses.field(default_factory=set)
    # The dense path with a bound page size P > 1 (a paged model run with use_cache=False):
    # int64 [pages * P], the dense token row [B * S] that lands in each page slot; None for
    # pages of one token (row b * S + t is page b * S + t).
    slots: torch.Tensor | None = None
    page_size: int = 1


_VIEW: contextvars.ContextVar[DenseView | None] = contextvars.ContextVar(
    "attn_dispatch.transformers.view", default=None
)


def _current_view(what: str) -> DenseView:
    view = _VIEW.get()
    if view is None:
        raise NoActiveScopeError(
            f"transformers {what} for implementation {IMPLEMENTATION!r} outside a forward "
            "wrapped by attn_dispatch.integrations.transformers.use(model, spec)"
        )
    return view


DenseView.__module__ = _PUBLIC_MODULE
