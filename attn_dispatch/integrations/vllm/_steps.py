"""One vLLM step -> ``AttnBatch``es by phase (torch only; no vLLM import)."""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch.backends.native.step_index import StepIndex
from attn_dispatch.backends.native.step_index import StepIndexer
from attn_dispatch.backends.native.step_index import step_indexer
from attn_dispatch.integrations.vllm._settings import MIXED_MODES
from attn_dispatch.integrations.vllm._settings import request_phase

#: The native step index (``step_indexer``), once looked up: empty until the first step; None
#: inside when the native library is not built (every step then built here, in Python).
_NATIVE_INDEX: list[StepIndexer | None] = []


def _native_index() -> StepIndexer | None:
    if not _NATIVE_INDEX:
        _NATIVE_INDEX.append(step_indexer())
    return _NATIVE_INDEX[0]


_PHASE_ORDER = (Phase.DECODE, Phase.VERIFY, Phase.PREFILL)
_MAX_BLOCK_ID = 2**30  # pages 2b and 2b + 1 stay within int32
#: Steps whose blocks read (requests x widest table) are at most this many are built from
#: Python ints (one host read); larger ones with tensor ops, whose fixed cost then pays off.
_LIST_CELLS = 4096


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
    are left out (vLLM pads a step with them). Pages are ``2 * block id`` (K of the block; V is
    the next page).

    Every input is checked first: a wrong one raises ``InvalidBatchError`` naming the field
    (and the request), before anything is built, so that no request is dropped or read out of
    another's pages.

    A step of one phase whose requests all have the same query length (every decode step, a
    speculative target's verify steps) is read, checked and built by one call into the native
    library when it is built (``step_indexer``): the same checks and the same batch. Any
    other step, and any step that call refuses, is read here, and a wrong one is named here.
    """
    _check_scalars(block_size, num_speculative_tokens, mixed, draft)
    index = _native_index()
    if index is not None:
        found = index(query_start_loc, seq_lens, block_table, block_size)
        if found is not None and found.min_q == found.max_q >= 1:
            part = _uniform_part(found, block_size, num_speculative_tokens, draft)
            if part is not None:
                return (part,)
    starts, q_lens, kv_lens, tables = _checked(
        query_start_loc, seq_lens, block_table, block_size=block_size
    )
    if q_lens and min(q_lens) == max(q_lens) == 1:
        # Every request decodes (request_phase of a single query token): one part, either mode.
        every = list(range(len(q_lens)))
        return (_part(0, Phase.DECODE, every, starts, q_lens, kv_lens, tables, block_size),)
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
    return tuple(
        _part(index, phase, reqs, starts, q_lens, kv_lens, tables, block_size)
        for index, (phase, reqs) in enumerate(groups.items())
    )


def _uniform_part(
    found: StepIndex, block_size: int, num_speculative_tokens: int, draft: bool
) -> StepPart | None:
    """The one part of a step whose requests all have ``found.max_q`` query tokens, when they
    are all of one phase (``request_phase`` depends on the cached length only through
    whether there is one, so its shortest and longest decide); else None."""
    q = found.max_q
    phase = request_phase(q, q + found.min_cached, num_speculative_tokens, draft=draft)
    if request_phase(q, found.max_kv, num_speculative_tokens, draft=draft) is not phase:
        return None
    first = found.first_token
    batch = AttnBatch._of_checked(
        phase,
        found.qo_indptr,
        found.kv_indptr,
        found.kv_indices,
        found.kv_lens,
        page_size=block_size,
        num_tokens=found.num_tokens,
        max_q_len=q,
        max_kv_len=found.max_kv,
    )
    return StepPart(0, batch, slice(first, first + found.num_tokens))


def _part(
    index: int,
    phase: Phase,
    reqs: list[int],
    starts: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    tables: list[list[int]] | torch.Tensor | None,
    block_size: int,
) -> StepPart:
    """The ``StepPart`` of requests ``reqs`` (checked, each with a query token) in ``phase``."""
    return StepPart(
        index,
        batch_from_lists(phase, reqs, q_lens, kv_lens, tables, block_size)
        if isinstance(tables, list)
        else batch_from_table(phase, reqs, q_lens, kv_lens, tables, block_size),
        _rows(reqs, starts, q_lens),
    )


def _integer_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` when it is an integer tensor on the CPU, or ``InvalidBatchError`` naming ``name``.

    The one rule of every index field, on both ways a step is built: any integer dtype
    (signed or unsigned, 8 to 64 bits; vLLM's are int32) whose values the checks below then
    bound; a host tensor, since the step is read on the host (a meta tensor has no values, a
    device tensor would be a copy per step that vLLM's CPU engine never makes).
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidBatchError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidBatchError(
            name, f"expected an integer tensor (any width, e.g. int32), got dtype {t.dtype}"
        )
    if t.device.type != "cpu":
        raise InvalidBatchError(
            name,
            f"expected a CPU tensor (the step is read on the host), got device {str(t.device)!r}",
        )
    return t


def _int_vector(name: str, t: object, length: int | None) -> list[int]:
    """The values of a 1-D integer tensor, or ``InvalidBatchError`` naming ``name``."""
    t = _integer_tensor(name, t)
    if t.dim() != 1:
        raise InvalidBatchError(name, f"expected one dimension, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise InvalidBatchError(
            name, f"expected {length} entries, got {t.shape[0]} (shape {tuple(t.shape)})"
        )
    values: list[int] = t.tolist()
    return values


def _checked(
    query_start_loc: object, seq_lens: object, block_table: object, *, block_size: int
) -> tuple[list[int], list[int], list[int], list[list[int]] | torch.Tensor | None]:
    """``(starts, q_lens, kv_lens, tables)`` of a valid step, or the first problem as an
    ``InvalidBatchError`` (fields are the ``step_parts`` argument names; the annotations say
    what is expected, the checks hold whatever a caller passes; ``block_size`` was checked by
    ``_check_scalars``). ``tables``: the block ids
    each request reads (the first ``need`` of its row, as read here, checked), when the step
    is small enough to read as Python ints (``_LIST_CELLS``); else the checked rows as an
    int32 or int64 tensor ``[R, widest]`` (``batch_from_table`` reads it); None when no
    request reads a block (no query token in the step)."""
    starts, q_lens, kv_lens = step_lengths(query_start_loc, seq_lens)
    # The blocks each request reads (none for a request left out: its row is never read).
    need = [-(-kv // block_size) if q else 0 for q, kv in zip(q_lens, kv_lens, strict=True)]
    return starts, q_lens, kv_lens, step_blocks(block_table, need, kv_lens, block_size)


def _check_scalars(
    block_size: object, num_speculative_tokens: object, mixed: object, draft: object
) -> None:
    """``step_parts``' scalar arguments, checked once per step before any tensor is read."""
    for name, value, low in (
        ("block_size", block_size, 1),
        ("num_speculative_tokens", num_speculative_tokens, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidBatchError(name, f"expected an int >= {low}, got {value!r}")
    if mixed not in MIXED_MODES:
        raise InvalidBatchError("mixed", f"expected one of {MIXED_MODES!r}, got {mixed!r}")
    if not isinstance(draft, bool):
        raise InvalidBatchError("draft", f"expected a bool, got {draft!r}")


def step_lengths(
    query_start_loc: object, seq_lens: object
) -> tuple[list[int], list[int], list[int]]:
    """``(starts, q_lens, kv_lens)`` of a step, checked: offsets that start at 0 or later and
    never decrease, ``seq_lens`` (cached + new tokens) at least each query length; else an
    ``InvalidBatchError`` naming the field and the request."""
    starts = _int_vector("query_start_loc", query_start_loc, None)
    if not starts:
        raise InvalidBatchError("query_start_loc", "expected R + 1 >= 1 entries, got none")
    kv_lens = _int_vector("seq_lens", seq_lens, len(starts) - 1)
    if starts[0] < 0:
        raise InvalidBatchError("query_start_loc", f"starts at {starts[0]!r}, expected >= 0")
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    # One pass in C over a valid step; the loop below names the first problem.
    if q_lens and (min(q_lens) < 0 or any(map(operator.lt, kv_lens, q_lens))):
        _name_length_problem(starts, q_lens, kv_lens)
    return starts, q_lens, kv_lens


def step_blocks(
    block_table: object,
    need: list[int],
    lens: list[int],
    block_size: int,
    *,
    lens_name: str = "seq_lens",
    as_lists: bool | None = None,
) -> list[list[int]] | torch.Tensor | None:
    """The block ids each request reads (request i: the first ``need[i]`` of its row), checked:
    an integer CPU table with a row per request, wide enough, ids in ``[0, 2**30)``; else an
    ``InvalidBatchError`` naming the request. ``lens`` (named ``lens_name``) are the token
    counts ``need`` was computed from, for the message.

    As Python ints (``list[list[int]]``) when the step is small (``_LIST_CELLS``), else the
    checked rows ``[R, widest]`` as an int32 or int64 tensor (``as_lists`` True or False: that
    form whatever the size); None when no request reads a block.
    """
    block_table = _integer_tensor("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] < len(need):
        raise InvalidBatchError(
            "block_table",
            f"expected [{len(need)}, max_blocks] (a row per request), got shape "
            f"{tuple(block_table.shape)}",
        )
    width = block_table.shape[1]
    wmax = max(need, default=0)
    for i, n in enumerate(need if wmax > width else ()):
        if n > width:
            raise InvalidBatchError(
                "block_table",
                f"{width} block(s) per row, but {lens_name} {lens[i]!r} at block_size "
                f"{block_size!r} needs {n}",
                request=i,
            )
    if not wmax:
        return None
    if as_lists if as_lists is not None else len(need) * wmax <= _LIST_CELLS:
        # The common step (decodes over short tables): one host read of the blocks read, and
        # the check and the batch both work on those ints (a torch op costs ~1-3 us here).
        listed: list[list[int]] = block_table[: len(need), :wmax].tolist()
        tables = [row[:n] for row, n in zip(listed, need, strict=True)]
        # One pass over every block read (wmax > 0: there is one); the loop names the request.
        flat = list(itertools.chain.from_iterable(tables))
        if min(flat) < 0 or max(flat) >= _MAX_BLOCK_ID:
            for i, blocks in enumerate(tables):
                if blocks and (min(blocks) < 0 or max(blocks) >= _MAX_BLOCK_ID):
                    raise _bad_blocks(i, need[i], blocks)
        return tables
    read = torch.arange(wmax).unsqueeze(0) < torch.tensor(need).unsqueeze(1)
    sub = block_table[: len(need), :wmax]
    if sub.dtype not in (torch.int32, torch.int64):
        # The list path reads any integer dtype as Python ints; the same values here: int64
        # holds every id the bound below lets through (and an 8-bit id cannot be compared
        # with the bound, nor doubled into a page index, in its own dtype).
        sub = sub.to(torch.int64)
    # Page 2b + 1 (V of block b) must fit the int32 page indices the batch carries.
    bad = ((sub < 0) | (sub >= _MAX_BLOCK_ID)) & read
    if bool(bad.any()):
        i = int(bad.any(dim=1).nonzero()[0])
        raise _bad_blocks(i, need[i], block_table[i, : need[i]].tolist())
    return sub


def _name_length_problem(starts: list[int], q_lens: list[int], kv_lens: list[int]) -> None:
    """Raise the first query/KV length problem of a step (``_checked`` found one)."""
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q < 0:
            raise InvalidBatchError(
                "query_start_loc",
                f"decreases from {starts[i]!r} to {starts[i + 1]!r} (a negative query length; "
                "offsets must not decrease)",
                request=i,
            )
        if kv < 0:
            raise InvalidBatchError("seq_lens", f"negative length {kv!r}", request=i)
        if kv < q:
            raise InvalidBatchError(
                "seq_lens",
                f"{kv!r} tokens, fewer than the request's {q!r} query tokens (seq_lens counts "
                "the cached and the new tokens)",
                request=i,
            )


def _bad_blocks(i: int, need: int, blocks: list[int]) -> InvalidBatchError:
    # Page 2b + 1 (V of block b) must fit the int32 page indices the batch carries.
    return InvalidBatchError(
        "block_table",
        f"block ids must be in [0, {_MAX_BLOCK_ID}); the {need} block(s) the request reads "
        f"are {blocks!r}",
        request=i,
    )


def _rows(reqs: list[int], starts: list[int], q_lens: list[int]) -> slice | torch.Tensor:
    first, last = reqs[0], reqs[-1]
    if last - first + 1 == len(reqs):  # consecutive requests: one slice of q, no copy
        return slice(starts[first], starts[last] + q_lens[last])
    return torch.cat([torch.arange(starts[i], starts[i] + q_lens[i]) for i in reqs])


def batch_from_lists(
    phase: Phase,
    reqs: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    tables: list[list[int]],
    block_size: int,
) -> AttnBatch:
    """One phase's ``AttnBatch`` of requests ``reqs`` from their checked block ids as ints
    (``tables[i]``: request i's blocks; ``kv_lens[i]`` its tokens): one tensor holds the four
    index vectors, every plan copies them and checks its copy.

    The batch is not checked a second time (``AttnBatch._of_checked``): ``step_parts`` checked
    what it is built from, and these are its values by construction. Each request has a
    query token (``q_lens[i] >= 1``), no more than its ``kv_lens[i]`` (``step_lengths``), and
    the ``ceil(kv_lens[i] / block_size)`` blocks it reads (``step_blocks``), ids in
    ``[0, 2**30)``, so its pages ``2b`` are non-negative int32; the offsets are their running
    sums from 0; a DECODE phase holds only single-token requests (``request_phase``).
    """
    sel_q = [q_lens[i] for i in reqs]
    sel_kv = [kv_lens[i] for i in reqs]
    qo = list(itertools.accumulate(sel_q, initial=0))
    kv = list(itertools.accumulate((len(tables[i]) for i in reqs), initial=0))
    pages = [2 * b for i in reqs for b in tables[i]]
    r = len(reqs)
    # From an int32 array: a third of torch.tensor's time on a list (the values are checked
    # ints below 2**31: lengths, offsets and pages 2b + 1 < 2**31).
    buf = torch.frombuffer(array.array("i", qo + kv + sel_kv + pages), dtype=torch.int32)
    qo_t, kv_t, lens_t, idx_t = buf.split_with_sizes((r + 1, r + 1, r, len(pages)))
    return AttnBatch._of_checked(
        phase,
        qo_t,
        kv_t,
        idx_t,
        lens_t,
        page_size=block_size,
        num_tokens=qo[-1],
        max_q_len=max(sel_q),
        max_kv_len=max(sel_kv),
    )


def batch_from_table(
    phase: Phase,
    reqs: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    block_table: torch.Tensor | None,
    block_size: int,
) -> AttnBatch:
    """One phase's ``AttnBatch`` from the checked rows (int32 or int64, ids in range)."""
    assert block_table is not None  # a present phase has a request that reads a block
    sel_q = [q_lens[i] for i in reqs]
    sel_kv = [kv_lens[i] for i in reqs]
    pages = [-(-k // block_size) for k in sel_kv]
    idx = torch.tensor(reqs, dtype=torch.int64)
    table = block_table.index_select(0, idx)
    width = max(pages)
    keep = torch.arange(width).unsqueeze(0) < torch.tensor(pages).unsqueeze(1)
    # Ids are < 2**30 (checked): doubled in int32, page 2b + 1 still fits.
    kv_indices = table[:, :width][keep].to(torch.int32) * 2
    i32 = torch.int32
    return AttnBatch(
        phase=phase,
        qo_indptr=torch.tensor(list(itertools.accumulate(sel_q, initial=0)), dtype=i32),
        kv_indptr=torch.tensor(list(itertools.accumulate(pages, initial=0)), dtype=i32),
        kv_indices=kv_indices,
        kv_lens=torch.tensor(sel_kv, dtype=i32),
        page_size=block_size,
    )


__all__ = [
    "StepPart",
    "batch_from_lists",
    "batch_from_table",
    "step_blocks",
    "step_lengths",
    "step_parts",
]
