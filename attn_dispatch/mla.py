"""Helpers for DeepSeek-style MLA layers in the decompressed forms (needs torch).

form = attention_form()
if form is AttnForm.MLA:
    out_latent = attention(q_absorbed, latent_cache, None, sm_scale=s)
elif form is AttnForm.MHA:
    k, v = up_proj(gather_latent(latent_cache, batch))      # whole sequences, ragged
    out = attention(q, k, v, sm_scale=s)
else:  # AttnForm.MHA_CHUNKED
    chunks = latent_prefix_chunks(latent_cache, batch, up_proj, chunk_tokens=4096)
    out = attention(q, k_new, v_new, sm_scale=s, prefix=chunks)
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import InvalidBatchError

UpProj = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _token_rows(
    batch: AttnBatch, request: int, start: int, stop: int, page_size: int
) -> torch.Tensor:
    """Flat ``page * page_size + slot`` indices of tokens ``start:stop`` of ``request``."""
    dev = batch.kv_indices.device
    t = torch.arange(start, stop, device=dev)
    base = int(batch.kv_indptr_host[request])
    pages = batch.kv_indices[base + t // page_size].long()
    return pages * page_size + t % page_size


def gather_latent(
    latent_cache: torch.Tensor, batch: AttnBatch, *, prefix_only: bool = False
) -> torch.Tensor:
    """Rows ``[sum(len), D]`` of every request's tokens, request after request, in order.

    With ``prefix_only`` only the cached prefix (``kv_len - q_len`` tokens) of each request.
    """
    if latent_cache.dim() != 3:
        raise InvalidBatchError(
            "latent_cache", f"want [pages, page_size, D], got {tuple(latent_cache.shape)}"
        )
    ps = latent_cache.shape[1]
    flat = latent_cache.reshape(-1, latent_cache.shape[-1])
    lens = batch.kv_lens_host.tolist()
    q_lens = batch.q_lens()
    parts = [
        _token_rows(batch, i, 0, lens[i] - (q_lens[i] if prefix_only else 0), ps)
        for i in range(batch.num_requests)
    ]
    rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=flat.device)
    return flat[rows]


def latent_prefix_chunks(
    latent_cache: torch.Tensor, batch: AttnBatch, up_proj: UpProj, *, chunk_tokens: int = 4096
) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Decompress the cached prefix chunk by chunk, for ``AttnForm.MHA_CHUNKED``.

    Each chunk covers up to ``chunk_tokens`` prefix positions of every request and yields
    ``(k, v, indptr)``: ``k``/``v`` from ``up_proj(latent_rows)`` and request ``i``'s rows at
    ``indptr[i]:indptr[i+1]``. Only one chunk's K/V exists at a time.
    """
    if chunk_tokens <= 0:
        raise InvalidBatchError("chunk_tokens", f"must be positive, got {chunk_tokens!r}")
    ps = latent_cache.shape[1]
    flat = latent_cache.reshape(-1, latent_cache.shape[-1])
    prefix = [k - q for k, q in zip(batch.kv_lens_host.tolist(), batch.q_lens(), strict=True)]
    longest = max(prefix, default=0)
    for c0 in range(0, longest, chunk_tokens):
        c1 = c0 + chunk_tokens
        parts, indptr = [], [0]
        for i, p in enumerate(prefix):
            lo, hi = min(c0, p), min(c1, p)
            parts.append(_token_rows(batch, i, lo, hi, ps))
            indptr.append(indptr[-1] + hi - lo)
        k, v = up_proj(flat[torch.cat(parts)])
        yield k, v, indptr
