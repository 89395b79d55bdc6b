"""Reading masks: the 2-D padding mask of each forward, and the mask functions transformers
asks the registered mask function (``dispatch_mask``) to build.

``use()`` registers ``dispatch_mask`` with its attention function (``AttentionMaskInterface``):
a custom attention name without a mask function makes transformers skip mask creation
(``attention_mask=None``), which silently drops causal masking of multi-token steps. Ours
receives each mask request, accepts transformers' causal, sliding-window causal and chunked
causal masks, refuses patterns it does not represent (bidirectional, packed sequences, custom
or/and masks) and returns None: the attention function applies causality, the window, the
chunks and padding itself, from the forward's page tables.

The 2-D ``attention_mask`` is read on the host once per forward (``_real_mask``): only each
row's real tokens are stored and attended, so the contract's causal, bottom-right aligned rule
is exactly transformers' causal + padding mask. A window or chunks count positions
differently in the two (transformers: the row's columns; the contract: the request's own
tokens), so padding inside a row is refused for those models (``_refuse_inner_padding``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import IMPLEMENTATION
from attn_dispatch.integrations.transformers._common import UnsupportedModelError
from attn_dispatch.integrations.transformers._view import _current_view
from attn_dispatch.integrations.transformers._view import _ModelMap


def _real_mask(named: dict[str, Any], cache: Any) -> tuple[int, int, torch.Tensor, Any]:
    """(batch, new tokens, bool [B, cached + new] real-token mask on the host, device)."""
    ids = named.get("input_ids")
    embeds = named.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None:
        raise UnsupportedModelError("a forward needs input_ids or inputs_embeds")
    b, q = int(ref.shape[0]), int(ref.shape[1])
    past = 0
    if cache is not None:
        try:
            past = int(cache.get_seq_length())
        except Exception as err:  # a cache object that is no transformers Cache
            raise UnsupportedModelError(
                f"cache of type {type(cache).__name__} cannot say its length ({err})"
            ) from err
    s = past + q
    mask = named.get("attention_mask")
    if mask is None:
        return b, q, torch.ones(b, s, dtype=torch.bool), ref.device
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise UnsupportedModelError(
            "attention_mask must be the 2-D padding mask [batch, cached + new] "
            f"(got {type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}); "
            "prepared 4-D masks cannot be mapped onto per-request kv ranges"
        )
    real = mask.detach().to("cpu", torch.bool)
    if tuple(real.shape) != (b, s):
        raise UnsupportedModelError(
            f"attention_mask has shape {tuple(real.shape)} but the cache holds {past} positions "
            f"and the forward adds {q} for {b} rows (= {(b, s)}); pass the mask of the whole "
            "sequence"
        )
    return b, q, real, ref.device


def _refuse_inner_padding(real: torch.Tensor, mapped: _ModelMap) -> None:
    # transformers windows absolute positions (padding included) and starts chunks after a
    # row's left padding only, the contract counts the request's own tokens: the same keys
    # only when a row's real tokens are contiguous.
    what = mapped.positional()
    if what is None:
        return
    counts = real.sum(dim=1)
    idx = torch.arange(real.shape[1])
    first = torch.where(real, idx, real.shape[1]).amin(dim=1)
    last = torch.where(real, idx, -1).amax(dim=1)
    bad = torch.nonzero((counts > 0) & (last - first + 1 != counts)).flatten().tolist()
    if bad:
        raise UnsupportedModelError(
            f"row {bad[0]} of attention_mask has padding between real tokens; {what} is "
            "served with left padding only (transformers counts positions, padding inside a "
            "row included). Choices: left-pad"
        )


def dispatch_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Any = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask-function signature. Returns None: the attention function applies
    causality, the window, the chunks and padding from the forward's batch. Accepts exactly
    transformers' causal mask and, for a model bound with sliding (chunked) layers, its
    sliding-window (chunked) causal mask of the config's width; refuses any other pattern."""
    from transformers.masking_utils import causal_mask_function

    window = _sliding_width(mask_function)
    chunk = _chunk_size(mask_function)
    if chunk is not None:
        return _chunked_mask(batch_size, q_length, kv_length, chunk, local_size)
    if mask_function is not None and mask_function is not causal_mask_function and window is None:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise UnsupportedModelError(
            f"the model asked for a mask pattern {name!r} beyond causal, sliding-window causal, "
            "chunked causal and padding (bidirectional, packed sequences or a custom overlay); "
            f"{IMPLEMENTATION!r} serves causal attention with an optional window or chunks "
            "and per-request padding only. Choices: keep transformers' own attention for this "
            "model"
        )
    view = _current_view("mask creation")
    bound_window = view.model.window if view.model is not None else None
    if window is not None and window != bound_window:
        raise UnsupportedModelError(
            f"the model asked for a sliding window of {window!r} tokens but was bound with "
            f"sliding_window={bound_window!r}"
        )
    if local_size is not None and local_size != window:
        raise UnsupportedModelError(f"local attention (size {local_size!r}) is not served")
    # A sliding layer's cache holds only the window's keys: its mask covers a suffix.
    shortest = view.kv_len if window is None else min(view.kv_len, window - 1 + view.q_len)
    if (batch_size, q_length) != (view.batch_size, view.q_len) or not (
        shortest <= kv_length <= view.kv_len
    ):
        raise InvalidBatchError(
            "attention_mask",
            f"mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not match the "
            f"forward's inputs (batch {view.batch_size}, q {view.q_len}, kv {view.kv_len})",
        )
    return None


def _chunked_mask(
    batch_size: int, q_length: int, kv_length: int, chunk: int, local_size: int | None
) -> None:
    """transformers' chunked causal mask (Llama 4): served when the model was bound with
    chunked layers of that size. Its chunks start after each row's left padding, the
    contract's at each request's first key: the same once inner padding is refused."""
    view = _current_view("mask creation")
    bound = view.model.chunk if view.model is not None else None
    if chunk != bound or local_size not in (None, chunk):
        raise UnsupportedModelError(
            f"the model asked for chunked attention of {chunk!r} tokens (local_size="
            f"{local_size!r}) but was bound with attention_chunk_size={bound!r}; "
            f"{IMPLEMENTATION!r} serves the chunk size the config names"
        )
    view.asked.add(GROUP_CHUNKED)
    if (batch_size, q_length, kv_length) != (view.batch_size, view.q_len, view.kv_len):
        raise InvalidBatchError(
            "attention_mask",
            f"chunked mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not "
            f"match the forward's inputs (batch {view.batch_size}, q {view.q_len}, kv "
            f"{view.kv_len})",
        )
    return None


def _cells(f: Any) -> dict[str, Any]:
    names = getattr(getattr(f, "__code__", None), "co_freevars", ())
    closure = getattr(f, "__closure__", None) or ()
    return {n: c.cell_contents for n, c in zip(names, closure, strict=False)}


def _overlay_cell(fn: Any, overlay: str, cell: str) -> Any:
    """The ``cell`` captured by ``overlay`` when ``fn`` is transformers' ``and_masks`` of that
    overlay and the causal function (how its sliding and chunked causal masks are built), else
    None."""
    from transformers.masking_utils import causal_mask_function

    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _cells(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", "") != f"{overlay}.<locals>.inner_mask":
        return None
    return _cells(parts[0]).get(cell)


def _chunk_size(fn: Any) -> int | None:
    """C when ``fn`` is transformers' ``chunked_causal_mask_function(C, left_padding)``."""
    size = _overlay_cell(fn, "chunked_overlay", "chunk_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _sliding_width(fn: Any) -> int | None:
    """W when ``fn`` is transformers' ``sliding_window_causal_mask_function(W)``."""
    width = _overlay_cell(fn, "sliding_window_overlay", "sliding_window")
    return width if isinstance(width, int) else None
