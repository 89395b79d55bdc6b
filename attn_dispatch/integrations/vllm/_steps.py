"""One vLLM step -> ``AttnBatch``es by phase (torch only; no vLLM import)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._phase import Phase
from attn_dispatch.integrations.vllm import request_phase

_PHASE_ORDER = (Phase.DECODE, Phase.VERIFY, Phase.PREFILL)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StepPart:
    """The requests of one phase in a step: its ``AttnBatch`` and its query rows."""

    index: int
    batch: AttnBatch
    rows: slice | torch.Tensor


def step_parts(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_speculative_tokens: int,
    mixed: str,
    draft: bool = False,
) -> tuple[StepPart, ...]:
    """Split one vLLM step into ``AttnBatch``es by phase (see the package docstring).

    ``query_start_loc`` int32 ``[R+1]``, ``seq_lens`` int32 ``[R]`` (cached + new tokens),
    ``block_table`` int32 ``[R, max_blocks]`` (vLLM block ids). Requests with no query token
    are left out. Pages are ``2 * block id`` (K of the block; V is the next page).
    """
    qo = query_start_loc.to(torch.int64)
    q_lens = (qo[1:] - qo[:-1]).tolist()
    kv_lens = seq_lens.tolist()
    starts = qo.tolist()
    phases = [
        request_phase(q, k, num_speculative_tokens, draft=draft) if q > 0 else None
        for q, k in zip(q_lens, kv_lens, strict=True)
    ]
    present = [p for p in _PHASE_ORDER if p in phases]
    if not present:
        return ()
    if mixed == "extend":
        groups = {present[-1]: [i for i, p in enumerate(phases) if p is not None]}
    else:
        groups = {ph: [i for i, p in enumerate(phases) if p is ph] for ph in present}
    out = []
    for index, (phase, reqs) in enumerate(groups.items()):
        out.append(
            StepPart(
                index,
                _batch(phase, reqs, q_lens, kv_lens, block_table, block_size),
                _rows(reqs, starts, q_lens),
            )
        )
    return tuple(out)


def _rows(reqs: list[int], starts: list[int], q_lens: list[int]) -> slice | torch.Tensor:
    first, last = reqs[0], reqs[-1]
    if last - first + 1 == len(reqs):  # consecutive requests: one slice of q, no copy
        return slice(starts[first], starts[last] + q_lens[last])
    return torch.cat([torch.arange(starts[i], starts[i] + q_lens[i]) for i in reqs])


def _batch(
    phase: Phase,
    reqs: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
) -> AttnBatch:
    sel_q = [q_lens[i] for i in reqs]
    sel_kv = [kv_lens[i] for i in reqs]
    pages = [-(-k // block_size) for k in sel_kv]
    idx = torch.tensor(reqs, dtype=torch.int64)
    table = block_table.index_select(0, idx)
    width = max(pages)
    keep = torch.arange(width).unsqueeze(0) < torch.tensor(pages).unsqueeze(1)
    kv_indices = (table[:, :width][keep] * 2).to(torch.int32)
    i32 = torch.int32
    return AttnBatch(
        phase=phase,
        qo_indptr=torch.tensor(list(itertools.accumulate(sel_q, initial=0)), dtype=i32),
        kv_indptr=torch.tensor(list(itertools.accumulate(pages, initial=0)), dtype=i32),
        kv_indices=kv_indices,
        kv_lens=torch.tensor(sel_kv, dtype=i32),
        page_size=block_size,
    )


__all__ = ["StepPart", "step_parts"]
