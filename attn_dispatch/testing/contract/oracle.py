"""The float64 reference oracle: the paged-KV attention contract written out once.

Every numeric test (the contract kit, each backend's own tests in this repository, the cascade
tests, the kernel-safety tests) compares against this module; nothing else restates the rules.
It is deliberately the slowest, plainest form: one request and one query head at a time, a
dense boolean mask of the keys each query sees, scores in float64.

The rules (docs: "Data contract", "Layer variants", "Attention types and state"):

* Token ``t`` of request ``i`` lives in page ``page_tables[i][t // page_size]``, slot
  ``t % page_size``; only the first ``kv_lens[i]`` tokens exist.
* Visible keys: the request's custom mask when it has one; else causal and bottom-right
  aligned (query ``j`` sits at position ``p = kv_len - q_len + j`` and sees ``0 ..= p``); a
  non-causal layer sees every key of its request.
* Chunked attention (``chunk = C``): a query at sequence position ``p`` sees only the keys of
  its chunk, ``(p // C) * C ..= p``. With a mask, ``p`` is the number of keys its mask allows
  minus one and the chunk is counted along those keys (a draft node's own sequence).
* Sliding window (``window_left = W``): of the keys left, the ``W + 1`` most recent (for a
  causal row: positions ``p - W ..= p``; for a tree node: the last ``W + 1`` keys its mask
  allows). Chunk first, then window: both bounds apply.
* Scores: ``s = q . (k * k_scale) * sm_scale``, then the logit cap ``cap * tanh(s / cap)``
  (``None`` or 0: off); values are ``v * v_scale``. An FP8 cache holds ``K / k_scale`` and
  ``V / v_scale``; MLA's V is the first ``v_head_dim`` columns of the latent row, scaled by
  ``k_scale`` with it.
* Grouped-query attention: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
* Sinks: one more logit per query head in the softmax's denominator, no value (a +inf sink
  takes all the weight: rows of 0; a -inf sink is no sink).
* ``lse``: natural log of the sum of ``exp(s)`` over the visible keys, the sink counted once;
  ``-inf`` for a row that sees no key (and has no sink).
* A row that sees no key (and no sink) gives zeros. Non-finite values propagate from the keys
  and values a row does see; invisible keys never reach it, whatever they hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "batch_layout",
    "reference",
    "reference_for_batch",
    "reference_state",
    "reference_state_for_batch",
    "visible_keys",
]


def visible_keys(
    q_len: int,
    kv_len: int,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    window_left: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """bool ``[q_len, kv_len]``: which keys of its request each query sees (module rules)."""
    if mask is not None:
        allowed = mask.to(device="cpu", dtype=torch.bool).reshape(q_len, kv_len).clone()
    elif causal:
        pos = torch.arange(kv_len)
        q_pos = kv_len - q_len + torch.arange(q_len)
        allowed = pos[None, :] <= q_pos[:, None]
    else:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    # Along each row's own sequence (its allowed keys in cache order): the rank of every key
    # from the row's start and from its end.
    if chunk is not None:
        seen = allowed.to(torch.int64)
        p = (seen.sum(-1, keepdim=True) - 1).clamp_min(0)  # the row's sequence position
        start = p - p % chunk
        allowed = allowed & (seen.cumsum(-1) - 1 >= start)
    if window_left is not None:
        from_end = allowed.flip(-1).to(torch.int64).cumsum(-1).flip(-1)
        allowed = allowed & (from_end <= window_left + 1)
    return allowed


def reference_state(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    *,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    sm_scale: float,
    v_head_dim: int | None = None,
    masks: Sequence[torch.Tensor] | None = None,
    causal: bool = True,
    window_left: int | None = None,
    chunk: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` in float64 on the CPU: out ``[tokens, Hq, Dv]``, lse ``[tokens, Hq]``.

    MHA when ``v_cache`` is given (``k_cache [P, page_size, Hkv, D]``); MLA when it is None
    (``k_cache [P, page_size, D]``, ``v_head_dim`` required). ``masks[i]`` is request i's
    ``[q_len, kv_len]`` bool mask (any shape with that many elements).
    """
    mla = v_cache is None
    if mla and v_head_dim is None:
        raise ValueError("MLA (v_cache None) needs v_head_dim")
    page_size = int(k_cache.shape[1])
    q = q.detach().cpu().double()
    keys_all = k_cache.detach().cpu().double() * k_scale
    if mla:
        values_all = keys_all[..., : int(v_head_dim)]  # type: ignore[arg-type]
        hkv = 1
    else:
        assert v_cache is not None
        values_all = v_cache.detach().cpu().double() * v_scale
        hkv = int(k_cache.shape[2])
    hq = int(q.shape[1])
    dv = int(values_all.shape[-1])
    group = hq // hkv
    sink_row = None if sinks is None else sinks.detach().cpu().double()
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), -math.inf, dtype=torch.float64)
    row = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        ql, kl = int(ql), int(kl)
        pos = torch.arange(kl)
        table = torch.as_tensor([int(p) for p in page_tables[i]], dtype=torch.long)
        page, slot = table[pos // page_size], pos % page_size
        allowed = visible_keys(
            ql,
            kl,
            mask=None if masks is None else masks[i],
            causal=causal,
            window_left=window_left,
            chunk=chunk,
        )
        for h in range(hq):
            if mla:
                keys, values = keys_all[page, slot], values_all[page, slot]
            else:
                keys, values = keys_all[page, slot, h // group], values_all[page, slot, h // group]
            s = (q[row : row + ql, h] @ keys.T) * sm_scale
            if logit_cap:
                s = logit_cap * torch.tanh(s / logit_cap)
            s = s.masked_fill(~allowed, -math.inf)
            if sink_row is not None:
                s = torch.cat([s, sink_row[h].expand(ql, 1)], dim=1)
            out[row : row + ql, h] = _weighted_values(torch.softmax(s, dim=-1), allowed, values)
            lse[row : row + ql, h] = torch.logsumexp(s, dim=-1)
        row += ql
    # A row that sees no key and has no sink (softmax of all -inf is NaN): the contract says 0.
    out[lse == -math.inf] = 0.0
    if sink_row is not None:  # a +inf sink takes all the weight (softmax gives NaN): 0
        out[:, sink_row == math.inf] = 0.0
    return out, lse


def _weighted_values(
    probs: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``sum_k probs[j, k] * values[k]`` over the keys row ``j`` sees (a sink column, when
    ``probs`` has one more, takes weight but has no value). Invisible values never enter the
    sum, so NaN or inf in a slot a row cannot see stays out of that row."""
    probs = probs[:, : values.shape[0]]
    if bool(torch.isfinite(values).all()):
        return probs @ values
    terms = probs[:, :, None] * values[None, :, :]
    return terms.masked_fill(~allowed[:, :, None], 0.0).sum(1)


def reference(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The ``out`` of ``reference_state`` (same arguments)."""
    return reference_state(*args, **kwargs)[0]


def batch_layout(
    batch: Any,
) -> tuple[list[int], list[int], list[list[int]], list[torch.Tensor] | None]:
    """``(q_lens, kv_lens, page_tables, masks)`` read from an ``AttnBatch`` (or any object
    with its fields: ``qo_indptr_host``, ``kv_indptr_host``, ``kv_lens_host``, ``kv_indices``,
    ``custom_mask``): the contract's own reading, independent of any backend's page code."""
    qo = [int(x) for x in batch.qo_indptr_host.tolist()]
    kv_indptr = [int(x) for x in batch.kv_indptr_host.tolist()]
    kv_lens = [int(x) for x in batch.kv_lens_host.tolist()]
    indices = [int(x) for x in batch.kv_indices.cpu().tolist()]
    q_lens = [qo[i + 1] - qo[i] for i in range(len(kv_lens))]
    tables = [indices[kv_indptr[i] : kv_indptr[i + 1]] for i in range(len(kv_lens))]
    masks = None
    if batch.custom_mask is not None:
        flat = batch.custom_mask.cpu()
        masks, at = [], 0
        for ql, kl in zip(q_lens, kv_lens, strict=True):
            masks.append(flat[at : at + ql * kl].view(ql, kl))
            at += ql * kl
    return q_lens, kv_lens, tables, masks


def reference_state_for_batch(
    config: Any,
    batch: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    sm_scale: float,
    *,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    **overrides: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_state`` for an ``AttnConfig`` and a batch: the layout from the batch, the
    variants (causal, window, chunk, cap, v_head_dim) from the config; ``overrides`` replace
    any of ``reference_state``'s keywords."""
    q_lens, kv_lens, tables, masks = batch_layout(batch)
    kwargs: dict[str, Any] = dict(
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        masks=masks,
        sm_scale=sm_scale,
        v_head_dim=config.v_head_dim or config.head_dim,
        causal=config.causal,
        window_left=config.window_left,
        chunk=config.attention_chunk_size,
        logit_cap=config.logit_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    kwargs.update(overrides)
    return reference_state(q, k_cache, v_cache, **kwargs)


def reference_for_batch(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The ``out`` of ``reference_state_for_batch`` (same arguments)."""
    return reference_state_for_batch(*args, **kwargs)[0]
