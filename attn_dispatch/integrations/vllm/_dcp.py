"""Decode context parallel (vLLM's ``decode_context_parallel_size``): one step's batches on one
rank, and one layer's attention over them.

vLLM shards every request's KV tokens over the ranks of a DCP group; which tokens a rank holds
is ``attn_dispatch.distributed.owned_positions`` (the ``"interleaved"`` layout, vLLM's
``cp_kv_cache_interleave_size``), the one definition of that layout: a rank's local cache holds
its positions in order, so a decode request's local length is how many it owns
(``local_lengths``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Any
from typing import Protocol

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._errors import UnsupportedModelError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attention
from attn_dispatch._scope import attn_scope
from attn_dispatch.distributed import owned_positions
from attn_dispatch.integrations.vllm._layers import LayerDispatch
from attn_dispatch.integrations.vllm._steps import batch_from_table
from attn_dispatch.integrations.vllm._steps import step_blocks
from attn_dispatch.integrations.vllm._steps import step_lengths

# Plan keys of the DCP batches (``DispatchMetadata.prepared``; step parts use 0, 1, 2).
DCP_DECODE, DCP_PROMPT = -1, -2


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DcpStep:
    """One step's batches on one decode-context-parallel rank (``dcp_step``).

    ``decode``: the single-token requests over this rank's share of their tokens
    (``owned_positions``); ``prompt``: requests with no cached context, over pages of their own
    new keys (``prompt_slots``: where each new token goes in those pages).
    """

    decode: AttnBatch | None
    decode_rows: torch.Tensor
    prompt: AttnBatch | None
    prompt_rows: torch.Tensor
    prompt_slots: torch.Tensor
    prompt_pages: int


def local_lengths(kv_lens: list[int], *, world: int, rank: int, interleave: int) -> list[int]:
    """How many of each request's ``kv_lens[i]`` tokens rank ``rank`` holds: the length of
    ``owned_positions(kv_len, rank=rank, world=world, interleave=interleave)``.

    The interleaved layout repeats every ``world * interleave`` tokens, so the rank's offsets
    in one such cycle (``owned_positions`` over one cycle) give every count: whole cycles times
    their number, plus those below the remainder. One layout call per step instead of one list
    of ``kv_len / world`` positions per request and step (milliseconds at long contexts).

    >>> local_lengths([5, 9, 2], world=2, rank=1, interleave=2)
    [2, 4, 0]
    """
    cycle = world * interleave
    offsets = owned_positions(cycle, rank=rank, world=world, interleave=interleave)
    out = []
    for kv in kv_lens:
        full, rest = divmod(kv, cycle)
        out.append(full * len(offsets) + bisect.bisect_left(offsets, rest))
    return out


def dcp_step(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    world: int,
    rank: int,
    interleave: int,
) -> DcpStep:
    """This step's batches on DCP rank ``rank`` of ``world`` (inputs as ``step_parts``'s, the
    block table holding this rank's blocks); a step this path cannot serve is an
    ``UnsupportedModelError`` naming the request, a malformed one an ``InvalidBatchError``."""
    starts, q_lens, kv_lens = step_lengths(query_start_loc, seq_lens)
    owned = local_lengths(kv_lens, world=world, rank=rank, interleave=interleave)
    dec_reqs: list[int] = []
    local_lens = [0] * len(q_lens)
    prompt_reqs: list[int] = []
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q == 0:
            continue
        if kv == q:
            prompt_reqs.append(i)
        elif q == 1:
            local = owned[i]
            if local == 0:
                raise UnsupportedModelError(
                    f"decode context parallel: request {i} ({kv} tokens) has no token on DCP "
                    f"rank {rank} (interleave {interleave}, {world} ranks); attn_dispatch "
                    "needs every rank to hold at least one. Choices: cp_kv_cache_interleave_size=1"
                )
            dec_reqs.append(i)
            local_lens[i] = local
        else:
            raise UnsupportedModelError(
                f"decode context parallel: request {i} runs {q} new tokens over {kv - q} cached "
                "ones (a prompt chunk over a cached prefix, or a speculative verify); "
                "attn_dispatch serves decode steps and prompts without cached context under "
                "decode_context_parallel_size > 1. Choices: enable_prefix_caching=False, "
                "enable_chunked_prefill=False, no speculative decoding"
            )
    i32 = torch.int32
    empty = torch.zeros(0, dtype=torch.int64)
    decode = None
    decode_rows = empty
    if dec_reqs:
        need = [-(-n // block_size) for n in local_lens]
        # Tensor ops: a decode over a long context reads many blocks (ints cost more there).
        table = step_blocks(
            block_table,
            need,
            local_lens,
            block_size,
            lens_name="this rank's share of seq_lens",
            as_lists=False,
        )
        assert isinstance(table, torch.Tensor)  # a decode request reads a block
        decode = batch_from_table(Phase.DECODE, dec_reqs, q_lens, local_lens, table, block_size)
        decode_rows = torch.tensor([starts[i] for i in dec_reqs], dtype=torch.int64)
    prompt = None
    prompt_rows = prompt_slots = empty
    n_pages = 0
    if prompt_reqs:
        lens = [q_lens[i] for i in prompt_reqs]
        pages = [-(-n // block_size) for n in lens]
        n_pages = sum(pages)
        base = list(itertools.accumulate(pages, initial=0))
        prompt = AttnBatch(
            phase=Phase.PREFILL if max(lens) > 1 else Phase.DECODE,
            qo_indptr=torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=i32),
            kv_indptr=torch.tensor(base, dtype=i32),
            kv_indices=torch.arange(n_pages, dtype=i32),
            kv_lens=torch.tensor(lens, dtype=i32),
            page_size=block_size,
        )
        prompt_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in prompt_reqs])
        prompt_slots = torch.cat(
            [torch.arange(n) + b * block_size for n, b in zip(lens, base, strict=False)]
        )
    return DcpStep(decode, decode_rows, prompt, prompt_rows, prompt_slots, n_pages)


class StepPlans(Protocol):
    """Where a step's plans are made once (``DispatchMetadata.prepared``)."""

    def prepared(self, binding: Binding, draft: bool, part: Any, batch: Any = None) -> Any: ...


def forward_dcp(
    step: DcpStep,
    plans: StepPlans,
    d: LayerDispatch,
    dcp_d: LayerDispatch,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    extras: dict[str, Any],
    *,
    rank: int,
) -> None:
    """One layer under decode context parallel, into ``out`` ``[tokens, heads, head_dim]``.

    Decode requests: the query heads of every DCP rank (all-gathered) attend to this rank's
    tokens with ``return_lse=True`` (``dcp_d``: the binding with the group's head count);
    every rank's ``(out, lse)`` is all-gathered and merged (``merge_states``, natural log), and
    this rank keeps its own heads. Prompt requests (no cached context): plain causal attention
    of the step's own keys, which every rank has in full for its heads, on pages built for the
    step.
    """
    from vllm.distributed.parallel_state import get_dcp_group

    from attn_dispatch.state import merge_states

    cfg = d.config
    heads = cfg.num_q_heads
    if step.decode is not None:
        group = get_dcp_group()
        q = query[step.decode_rows].reshape(-1, heads, cfg.head_dim).contiguous()
        q_all = group.all_gather(q, dim=1)
        prepared = plans.prepared(dcp_d.binding, False, DCP_DECODE, step.decode)
        with attn_scope(dcp_d.binding, step.decode, prepared):
            part_out, part_lse = attention(q_all, k_cache, v_cache, return_lse=True, **extras)
        outs = group.all_gather(part_out.unsqueeze(0).contiguous(), dim=0)
        lses = group.all_gather(part_lse.unsqueeze(0).contiguous(), dim=0)
        merged, _ = merge_states(list(outs.unbind(0)), list(lses.unbind(0)))
        out[step.decode_rows] = merged[:, rank * heads : (rank + 1) * heads].to(out.dtype)
    if step.prompt is not None:
        ps = cfg.page_size
        rows = step.prompt_rows
        k_new = key[rows].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v_new = value[rows].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        shape = (step.prompt_pages * ps, cfg.num_kv_heads, cfg.head_dim)
        k_pages = k_new.new_zeros(shape)
        v_pages = v_new.new_zeros(shape)
        k_pages.index_copy_(0, step.prompt_slots, k_new.to(k_pages.dtype))
        v_pages.index_copy_(0, step.prompt_slots, v_new.to(v_pages.dtype))
        kp = k_pages.view(-1, ps, cfg.num_kv_heads, cfg.head_dim)
        vp = v_pages.view(-1, ps, cfg.num_kv_heads, cfg.head_dim)
        q = query[rows].reshape(-1, heads, cfg.head_dim).contiguous()
        prepared = plans.prepared(d.binding, False, DCP_PROMPT, step.prompt)
        with attn_scope(d.binding, step.prompt, prepared):
            out[rows] = attention(q, kp, vp, **extras)


__all__ = [
    "DCP_DECODE",
    "DCP_PROMPT",
    "DcpStep",
    "StepPlans",
    "dcp_step",
    "forward_dcp",
    "local_lengths",
]
