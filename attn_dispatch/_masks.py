"""Mask folding for backends with a mask-taking kernel: the sliding window and chunked local
attention (``AttnConfig.window_left``, ``attention_chunk_size``) on custom (tree) masks.
Public through ``attn_dispatch.backend`` (loaded there on first use: these need torch).

Both are folded into the mask once per plan. A query of a tree sees the keys its mask allows,
in cache order (the prefix plus its ancestors, itself last), so its sequence position is
``allowed - 1``: exactly what decoding that path token by token would see. Fold the chunk
first, then the window (the window counts the keys the chunk left).

>>> window_tree_mask(torch.ones(1, 3, dtype=torch.bool), 1)
tensor([[False,  True,  True]])
>>> chunk_tree_mask(torch.ones(1, 5, dtype=torch.bool), 2)  # position 4: keys 4 ..= 4
tensor([[False, False, False, False,  True]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "chunk_flat_mask",
    "chunk_tree_mask",
    "per_request_mask",
    "window_flat_mask",
    "window_tree_mask",
]


def window_tree_mask(mask: torch.Tensor, window_left: int) -> torch.Tensor:
    """Apply a sliding window to a custom (tree) mask ``[..., queries, keys]`` (bool).

    A query sees the ``window_left + 1`` most recent keys *its mask allows* (in cache order):
    for a draft node that is the prefix plus its ancestors, so tree verify sees exactly what
    decoding that path token by token would see; for a causal mask it is the positional
    window ``p - window_left ..= p``. Backends with a mask-taking kernel can fold the window
    into the mask with this once per plan.

    >>> window_tree_mask(torch.ones(1, 3, dtype=torch.bool), 1)
    tensor([[False,  True,  True]])
    """
    # Count the allowed keys at or after each key: its rank from the query's end.
    rank = mask.flip(-1).to(torch.int32).cumsum(-1).flip(-1)
    return mask & (rank <= window_left + 1)


def window_flat_mask(
    custom_mask: torch.Tensor, q_lens: list[int], kv_lens: list[int], window_left: int
) -> torch.Tensor:
    """``window_tree_mask`` on a flat batch mask (see ``per_request_mask``)."""
    return per_request_mask(
        custom_mask, q_lens, kv_lens, lambda m: window_tree_mask(m, window_left)
    )


def per_request_mask(
    custom_mask: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    fold: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``fold`` applied to each request's ``[q_len, kv_len]`` block of a flat batch mask
    (the blocks one after the other, as ``AttnBatch.custom_mask``); returns a new flat mask."""
    parts = []
    off = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        parts.append(fold(custom_mask[off : off + ql * kl].view(ql, kl)).reshape(-1))
        off += ql * kl
    return torch.cat(parts) if parts else custom_mask[:0].clone()


def chunk_tree_mask(mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Keep, per row of a bool ``[..., queries, keys]`` mask, only the keys of the row's chunk
    (the last ``p % chunk + 1`` allowed keys, p = allowed keys - 1)."""
    count = mask.to(torch.int32).sum(-1, keepdim=True)  # the row's sequence length
    pos = (count - 1).clamp_min(0)
    start = pos - pos % chunk  # first sequence position of the row's chunk
    rank = mask.to(torch.int32).cumsum(-1) - 1  # each allowed key's sequence position
    return mask & (rank >= start)


def chunk_flat_mask(
    custom_mask: torch.Tensor, q_lens: list[int], kv_lens: list[int], chunk: int
) -> torch.Tensor:
    """``chunk_tree_mask`` on a flat batch mask (see ``per_request_mask``)."""
    return per_request_mask(custom_mask, q_lens, kv_lens, lambda m: chunk_tree_mask(m, chunk))


# Public through attn_dispatch.backend (loaded lazily there): reprs and docs name it.
for _fold in (
    chunk_flat_mask,
    chunk_tree_mask,
    per_request_mask,
    window_flat_mask,
    window_tree_mask,
):
    _fold.__module__ = "attn_dispatch.backend"
del _fold
