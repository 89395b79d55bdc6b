"""Attention state: merging the results of attention over disjoint key sets (needs torch).

A backend that returns its log-sum-exp (``attention(..., return_lse=True)``) gives the
*state* of a partial attention: ``out`` (the softmax-weighted mean of V over the keys it saw)
and ``lse`` (float32 ``[tokens, q_heads]``, the natural log of the sum of ``exp(score)`` over
those keys). Two states over disjoint key sets merge into the state over their union:

    lse   = log(exp(lse_a) + exp(lse_b))
    out   = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b)

An empty part has ``lse = -inf`` and contributes nothing, whatever its ``out`` holds (NaN
included); two empty parts give ``out = 0`` and ``lse = -inf``. A NaN lse gives a NaN row.

>>> import torch
>>> q, k, v = torch.randn(3, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
>>> def part(keys):          # attention over some keys: its state (out, lse)
...     s = torch.einsum("thd,khd->thk", q, k[keys])
...     return torch.einsum("thk,khd->thd", s.softmax(-1), v[keys]), s.logsumexp(-1)
>>> out_prefix, lse_prefix = part(slice(0, 4))
>>> out_suffix, lse_suffix = part(slice(4, 6))
>>> out, lse = merge_state(out_prefix, lse_prefix, out_suffix, lse_suffix)
>>> full_out, full_lse = part(slice(0, 6))
>>> torch.allclose(out, full_out, atol=1e-5), torch.allclose(lse, full_lse, atol=1e-5)
(True, True)
>>> (out_a, lse_a), (out_b, lse_b), (out_c, lse_c) = map(part, (slice(0, 1), [1, 2], [3, 4, 5]))
>>> out, lse = merge_states([out_a, out_b, out_c], [lse_a, lse_b, lse_c])
>>> torch.allclose(out, full_out, atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import torch

from attn_dispatch._errors import InvalidBatchError

__all__ = ["merge_state", "merge_states"]


def _listed(field: str, parts: Any) -> list[Any]:
    """``parts`` (any iterable: list, tuple, generator) as a list; one tensor or a string is
    refused, not iterated (a tensor iterates over its rows, which would merge tokens)."""
    if isinstance(parts, torch.Tensor):
        raise InvalidBatchError(
            field,
            f"got one tensor {tuple(parts.shape)}; pass a sequence of tensors, one per part: "
            "merge_states([out_a, out_b], [lse_a, lse_b]) (merge_state for two parts)",
        )
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Iterable):
        raise InvalidBatchError(
            field,
            f"got {type(parts).__name__}; pass a sequence (list, tuple or generator) of "
            "tensors, one per part",
        )
    return list(parts)


def _check(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> None:
    if len(outs) != len(lses):
        raise InvalidBatchError(
            "lse", f"got {len(outs)} outputs and {len(lses)} lse tensors; pass one lse per output"
        )
    if not outs:
        raise InvalidBatchError("out", "nothing to merge: pass at least one (out, lse) pair")
    first = outs[0]
    for i, (out, lse) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise InvalidBatchError(
                f"parts[{i}]",
                f"got {type(out).__name__} and {type(lse).__name__}; pass torch tensors "
                "out [tokens, heads, dv] and lse float32 [tokens, heads]",
            )
        if out.dim() != 3 or not out.is_floating_point():
            raise InvalidBatchError(
                f"out[{i}]",
                f"got {tuple(out.shape)} {out.dtype}; pass a floating tensor [tokens, heads, dv]",
            )
        if out.shape != first.shape or out.dtype != first.dtype or out.device != first.device:
            raise InvalidBatchError(
                f"out[{i}]",
                f"got {tuple(out.shape)} {out.dtype} on {out.device}, but out[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; the parts of one merge "
                "share shape, dtype and device",
            )
        if lse.dtype != torch.float32 or lse.shape != out.shape[:2] or lse.device != out.device:
            raise InvalidBatchError(
                f"lse[{i}]",
                f"got {tuple(lse.shape)} {lse.dtype} on {lse.device}; pass float32 "
                f"{tuple(out.shape[:2])} on {out.device} (tokens x heads of its output)",
            )


def merge_states(
    outs: Iterable[torch.Tensor], lses: Iterable[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of attention states over disjoint key sets into one.

    >>> import torch
    >>> q, k, v = torch.randn(3, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    >>> def part(keys):          # attention over some keys: its state (out, lse)
    ...     s = torch.einsum("thd,khd->thk", q, k[keys])
    ...     return torch.einsum("thk,khd->thd", s.softmax(-1), v[keys]), s.logsumexp(-1)
    >>> (out_a, lse_a), (out_b, lse_b), (out_c, lse_c) = map(part, ([0, 1], [2, 3], [4, 5]))
    >>> out, lse = merge_states([out_a, out_b, out_c], [lse_a, lse_b, lse_c])
    >>> torch.allclose(out, part(slice(0, 6))[0], atol=1e-5)
    True

    ``outs``: ``[tokens, heads, dv]`` of one floating dtype (the result has it);
    ``lses``: float32 ``[tokens, heads]``; any iterable of them (a generator too), one part or
    more (one part gives a copy of itself). The merge is computed in float32 in one pass over
    the parts (exact to float32 rounding); parts whose lse is ``-inf`` are left out, so their
    outputs never reach the result. Bad input raises ``InvalidBatchError`` naming the field
    (``outs``, ``lses``, ``out[i]``, ``lse[i]``, ``parts[i]``).
    """
    outs = _listed("outs", outs)
    lses = _listed("lses", lses)
    _check(outs, lses)
    lse = torch.stack(list(lses))  # [n, T, H]
    m = lse.amax(dim=0)
    empty = m == float("-inf")
    # exp(lse - m) is 1 at the largest part; where every part is empty, any finite shift keeps
    # the weights at exp(-inf) = 0 instead of exp(nan). A +inf part (a +inf sink) has weight 1
    # and every finite part 0: the union is that part.
    dominated = torch.isposinf(m)
    shift = torch.where(empty | dominated, torch.zeros_like(m), m)
    weights = torch.where(dominated, torch.isposinf(lse).float(), torch.exp(lse - shift))
    total = weights.sum(dim=0)
    acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for w, out in zip(weights, outs, strict=True):
        # A part of weight 0 (empty) is skipped even if its out holds NaN or inf.
        contrib = w.unsqueeze(-1) * out.float()
        acc += torch.where((w == 0).unsqueeze(-1), torch.zeros_like(contrib), contrib)
    safe_total = torch.where(empty, torch.ones_like(total), total)
    merged = acc / safe_total.unsqueeze(-1)
    merged_lse = torch.where(empty | dominated, m, shift + torch.log(safe_total))
    return merged.to(outs[0].dtype), merged_lse


def merge_state(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets: attention over their union.

    >>> import torch
    >>> q, k, v = torch.randn(3, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    >>> def part(keys):          # attention over some keys: its state (out, lse)
    ...     s = torch.einsum("thd,khd->thk", q, k[keys])
    ...     return torch.einsum("thk,khd->thd", s.softmax(-1), v[keys]), s.logsumexp(-1)
    >>> out_shared, lse_shared = part(slice(0, 4))     # a shared prefix's keys
    >>> out_own, lse_own = part(slice(4, 6))           # the request's own keys
    >>> out, lse = merge_state(out_shared, lse_shared, out_own, lse_own)
    >>> torch.allclose(out, part(slice(0, 6))[0], atol=1e-5)
    True

    See ``merge_states`` for shapes and the rules for empty parts.
    """
    return merge_states((out_a, out_b), (lse_a, lse_b))


# Public through attn_dispatch (loaded lazily there) as well as here: reprs name the package.
merge_state.__module__ = merge_states.__module__ = "attn_dispatch"
# doctest looks for an object's examples in the module its __module__ names, where these are
# loaded lazily (not in its namespace): list them here so that their examples run.
__test__ = {"merge_state": merge_state, "merge_states": merge_states}
