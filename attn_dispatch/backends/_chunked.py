"""Chunked local attention (``AttnConfig.attention_chunk_size``) on custom (tree) masks.

A query at position p of its sequence sees keys ``(p // C) * C ..= p``. With a tree mask the
sequence of a draft node is the keys its mask allows, in cache order (the prefix plus its
ancestors, itself last), so its position is ``allowed - 1`` and it keeps the last
``p % C + 1`` keys its mask allows: exactly what decoding that path token by token would see.
Like the window (``_common.window_tree_mask``) this is folded into the mask once per plan;
fold the chunk first, then the window (the window counts the keys the chunk left).

>>> chunk_tree_mask(torch.ones(1, 5, dtype=torch.bool), 2)  # position 4: keys 4 ..= 4
tensor([[False, False, False, False,  True]])
"""

from __future__ import annotations

import torch

from attn_dispatch.backends._common import per_request_mask


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
    """``chunk_tree_mask`` on a flat batch mask (see ``_common.per_request_mask``)."""
    return per_request_mask(custom_mask, q_lens, kv_lens, lambda m: chunk_tree_mask(m, chunk))
