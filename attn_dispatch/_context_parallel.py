"""Context-parallel attention: which KV tokens a rank owns, its verify mask, its shard, merging.

Behind ``attn_dispatch.distributed`` (which exports these names); a module of its own because
it is one concept, apart from the ranks' agreement at start-up.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import NoProcessGroupError as _NoGroupError
from attn_dispatch._phase import Phase

if TYPE_CHECKING:
    import torch


Layout = Literal["contiguous", "interleaved"]


def owned_positions(
    kv_len: int, *, rank: int, world: int, layout: Layout = "interleaved", interleave: int = 1
) -> list[int]:
    """The global token positions of a ``kv_len``-token request that ``rank`` holds, in order.

    ``"interleaved"`` is vLLM's decode-context-parallel layout: blocks of ``interleave``
    consecutive tokens go to the ranks in turn (token t lives on rank
    ``(t // interleave) % world``). ``"contiguous"`` splits the request into ``world`` runs of
    ``ceil(kv_len / world)`` tokens (the last ones shorter or empty). Every position is owned by
    exactly one rank; a rank's local cache holds its positions in this order.
    """
    for name, value, low in (
        ("kv_len", kv_len, 0),
        ("world", world, 1),
        ("interleave", interleave, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidBatchError(name, f"must be an int >= {low}, got {value!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise InvalidBatchError("rank", f"must be an int in [0, {world}), got {rank!r}")
    if layout == "interleaved":
        return [t for t in range(kv_len) if (t // interleave) % world == rank]
    if layout == "contiguous":
        step = math.ceil(kv_len / world) if kv_len else 0
        return list(range(min(rank * step, kv_len), min((rank + 1) * step, kv_len)))
    raise InvalidBatchError("layout", f"choose 'interleaved' or 'contiguous', got {layout!r}")


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidBatchError(name, f"must be an int >= {low}, got {value!r}")


def _positions(owned: object, kv_len: int) -> list[int]:
    """``owned`` as a list of distinct ints in ``[0, kv_len)``, or ``InvalidBatchError``."""
    if isinstance(owned, (str, bytes)) or not hasattr(owned, "__iter__"):
        raise InvalidBatchError(
            "owned", f"pass a sequence of token positions, got {type(owned).__name__}"
        )
    out = []
    for i, p in enumerate(owned):
        # operator.index: ints, numpy and 0-d torch integers; never a float or a bool.
        try:
            value = operator.index(p) if not isinstance(p, bool) else None
        except TypeError:
            value = None
        if value is None:
            raise InvalidBatchError(
                "owned", f"position {i} is {p!r} ({type(p).__name__}); positions are ints"
            )
        if not 0 <= value < kv_len:
            raise InvalidBatchError(
                "owned", f"position {i} is {value}; positions must lie in [0, {kv_len})"
            )
        out.append(value)
    if len(set(out)) != len(out):
        dup = sorted({p for p in out if out.count(p) > 1})
        raise InvalidBatchError(
            "owned", f"positions {dup} are listed more than once; each key is held once"
        )
    return out


def local_verify_mask(
    q_len: int, kv_len: int, owned: Sequence[int], tree: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``[q_len, len(owned)]`` mask of one request's local keys on one rank.

    Query j sits at global position ``kv_len - q_len + j``; it may see local key i when the
    global rule allows it for ``owned[i]``: causal by global position, or ``tree[j, owned[i]]``
    for a tree verify (``tree`` is the request's global ``[q_len, kv_len]`` mask). Pass the
    concatenation of these blocks as the local batch's ``custom_mask`` (a config with
    ``tree_verify=True``): the local kernel cannot know global positions by itself.
    """
    import torch

    _check_int("kv_len", kv_len, 0)
    _check_int("q_len", q_len, 0)
    if q_len > kv_len:
        # Query j sits at global position kv_len - q_len + j: a query before the request's
        # first token names no position (the batch contract: kv_len >= q_len).
        raise InvalidBatchError(
            "q_len", f"{q_len} queries over {kv_len} tokens; q_len must be <= kv_len"
        )
    pos = torch.as_tensor(_positions(owned, kv_len), dtype=torch.long)
    if tree is not None:
        if not isinstance(tree, torch.Tensor):
            raise InvalidBatchError(
                "tree",
                f"must be a bool torch.Tensor [{q_len}, {kv_len}], got {type(tree).__name__}",
            )
        if tuple(tree.shape) != (q_len, kv_len) or tree.dtype != torch.bool:
            raise InvalidBatchError(
                "tree", f"must be bool [{q_len}, {kv_len}], got {tuple(tree.shape)} {tree.dtype}"
            )
        return tree[:, pos.to(tree.device)].clone()
    qpos = torch.arange(kv_len - q_len, kv_len, dtype=torch.long)
    return pos.unsqueeze(0) <= qpos.unsqueeze(1)


def merge_ranks(
    out: torch.Tensor, lse: torch.Tensor, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's attention state and merge: attention over every rank's keys.

    ``out`` ``[tokens, heads, dv]`` and ``lse`` float32 ``[tokens, heads]`` are this rank's
    result of ``attention(..., return_lse=True)`` over its own keys (rows with no local key have
    ``lse = -inf``); every rank gets the merged ``(out, lse)``.
    """
    import torch
    import torch.distributed as dist

    from attn_dispatch.state import merge_states

    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise InvalidBatchError("out", f"must be [tokens, heads, dv], got {_shape_of(out)}")
    if (
        not isinstance(lse, torch.Tensor)
        or tuple(lse.shape) != tuple(out.shape[:2])
        or lse.dtype != torch.float32
    ):
        raise InvalidBatchError(
            "lse",
            f"must be float32 [{out.shape[0]}, {out.shape[1]}] (out's tokens and heads), got "
            f"{_shape_of(lse)}",
        )
    if not dist.is_available() or not dist.is_initialized():
        raise _NoGroupError()
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_states(outs, lses)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RankShard:
    """One rank's part of a context-parallel batch (``shard_for_rank``).

    ``batch``, ``k_cache`` and ``v_cache`` are the rank's local paged batch and caches (its
    own tokens of every request, in global order, on fresh pages); ``rows`` are the global
    query rows the local batch serves (int64), for ``expand_state``. A query that sees no
    local key (a decode request with no token here, a verify query whose visible keys all
    live elsewhere) is left out: its state on this rank is empty. A verify request whose local
    keys are fewer than its kept queries is padded with masked slots, so the batch contract
    (``kv_len >= q_len``) holds and the padding is never attended.
    """

    batch: Any
    k_cache: Any
    v_cache: Any
    rows: Any
    num_tokens: int


def shard_for_rank(
    batch: Any,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    *,
    rank: int,
    world: int,
    layout: Layout = "interleaved",
    interleave: int = 1,
    masks: Sequence[torch.Tensor] | None = None,
) -> RankShard:
    """Cut a global paged batch into ``rank``'s context-parallel part (for tests and demos).

    In a deployment each rank writes its own tokens into its own cache as they arrive; this
    builds the same local state from one global cache, so the recipe can be checked against
    attention over every key. DECODE stays DECODE (its single query sees every earlier key);
    VERIFY gets a ``custom_mask`` from ``local_verify_mask`` (bind the runner with
    ``tree_verify=True``). ``masks`` are the global per-request tree masks of a tree verify.
    """
    import torch

    from attn_dispatch._batch import AttnBatch

    if not isinstance(batch, AttnBatch):
        raise InvalidBatchError("batch", f"pass an AttnBatch, got {type(batch).__name__}")
    phase = batch.phase
    if phase is Phase.PREFILL:
        raise InvalidBatchError(
            "phase", "context-parallel sharding serves DECODE and VERIFY batches; got PREFILL"
        )
    owned_positions(0, rank=rank, world=world, layout=layout, interleave=interleave)
    _check_caches(batch, k_cache, v_cache)
    if masks is not None and (isinstance(masks, torch.Tensor) or len(masks) != batch.num_requests):
        raise InvalidBatchError(
            "masks",
            f"pass one [q_len, kv_len] bool mask per request ({batch.num_requests}), got "
            f"{type(masks).__name__} of length {len(masks)}",
        )
    ps = k_cache.shape[1]
    qo = batch.qo_indptr_host.tolist()
    lens = batch.kv_lens_host.tolist()
    kv_indptr = batch.kv_indptr_host.tolist()
    indices = batch.kv_indices.cpu().tolist()
    q_lens, kv_lens, tables, local_masks, rows = [], [], [], [], []
    k_rows: list[torch.Tensor] = []
    v_rows: list[torch.Tensor] = []
    next_page = 0
    for i, kl in enumerate(lens):
        ql = qo[i + 1] - qo[i]
        own = owned_positions(kl, rank=rank, world=world, layout=layout, interleave=interleave)
        q_rows = list(range(qo[i], qo[i + 1]))
        mask = None
        if phase is Phase.VERIFY:
            m = local_verify_mask(ql, kl, own, None if masks is None else masks[i])
            # Queries that see no local key take no part here (their state on this rank is
            # empty): the batch contract wants every row to attend at least one key.
            keep = m.any(dim=1)
            q_rows = [r for r, k in zip(q_rows, keep.tolist(), strict=True) if k]
            mask = m[keep]
        if not own or not q_rows:
            continue
        n = max(len(own), len(q_rows))
        pad = n - len(own)
        pages = [indices[kv_indptr[i] + t // ps] for t in own]
        slots = [t % ps for t in own]
        keys = k_cache[pages, slots]
        k_rows.append(torch.cat((keys, keys.new_zeros((pad, *keys.shape[1:])))))
        if v_cache is not None:
            vals = v_cache[pages, slots]
            v_rows.append(torch.cat((vals, vals.new_zeros((pad, *vals.shape[1:])))))
        npages = -(-n // ps)
        tables.append(list(range(next_page, next_page + npages)))
        next_page += npages
        q_lens.append(len(q_rows))
        kv_lens.append(n)
        rows.extend(q_rows)
        if mask is not None:
            # Padding slots (so that kv_len >= q_len) are never attended.
            local_masks.append(torch.cat((mask, mask.new_zeros((len(q_rows), pad))), dim=1))

    def paged(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        out = like.new_zeros((max(next_page, 1), ps, *like.shape[2:]))
        for part, table in zip(parts, tables, strict=True):
            # A request's pages are consecutive here, so its tokens are one flat run.
            out[table[0] : table[0] + len(table)].view(-1, *like.shape[2:])[: part.shape[0]] = part
        return out

    local_k = paged(k_rows, k_cache)
    local_v = None if v_cache is None else paged(v_rows, v_cache)
    local = None
    if q_lens:
        local = AttnBatch.build(
            phase,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            page_size=ps,
            num_pages=local_k.shape[0],
            masks=local_masks if phase is Phase.VERIFY else None,
            device=batch.kv_indices.device,
        )
    return RankShard(
        batch=local,
        k_cache=local_k,
        v_cache=local_v,
        rows=torch.as_tensor(rows, dtype=torch.long),
        num_tokens=int(qo[-1]),
    )


def _check_caches(batch: Any, k_cache: Any, v_cache: Any) -> None:
    """The global caches ``shard_for_rank`` cuts from: MHA ``[P, page, Hkv, D]`` with V
    ``[P, page, Hkv, Dv]``, MLA ``[P, page, D]`` with no V; every page the batch names and
    every token it counts inside them."""
    import torch

    if not isinstance(k_cache, torch.Tensor):
        raise InvalidBatchError("k_cache", f"pass a torch.Tensor, got {type(k_cache).__name__}")
    want = 3 if v_cache is None else 4
    if k_cache.dim() != want:
        layout = "[pages, page_size, D] (MLA)" if v_cache is None else "[pages, page_size, Hkv, D]"
        raise InvalidBatchError("k_cache", f"must be {layout}, got shape {tuple(k_cache.shape)}")
    if v_cache is not None:
        if not isinstance(v_cache, torch.Tensor):
            raise InvalidBatchError(
                "v_cache", f"pass a torch.Tensor or None, got {type(v_cache).__name__}"
            )
        if v_cache.dim() != 4 or tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
            raise InvalidBatchError(
                "v_cache",
                f"must be [pages, page_size, Hkv, Dv] with the pages, page size and heads of "
                f"k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}",
            )
    pages, ps = int(k_cache.shape[0]), int(k_cache.shape[1])
    if ps < 1:
        raise InvalidBatchError("k_cache", f"has page size {ps}; pages hold >= 1 token")
    if batch.page_size is not None and batch.page_size != ps:
        raise InvalidBatchError(
            "k_cache", f"has page size {ps}, but the batch was built for {batch.page_size}"
        )
    indices = batch.kv_indices.cpu()
    if indices.numel() and int(indices.max()) >= pages:
        raise InvalidBatchError(
            "kv_indices", f"name page {int(indices.max())}, but k_cache holds {pages} pages"
        )
    kv = batch.kv_indptr_host.tolist()
    for i, kl in enumerate(batch.kv_lens_host.tolist()):
        have = kv[i + 1] - kv[i]
        if have * ps < kl:
            raise InvalidBatchError(
                "kv_indptr",
                f"{have} page(s) of {ps} tokens cannot hold kv_len {kl}",
                request=i,
            )


def expand_state(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    shard: RankShard,
    *,
    like: torch.Tensor,
    v_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's state over every global query row: its local result where it served the row,
    ``(0, -inf)`` (an empty part, which ``merge_states`` leaves out) elsewhere.

    ``like`` is the global ``q`` (dtype, device, head count).
    """
    import torch

    if not isinstance(shard, RankShard):
        raise InvalidBatchError("shard", f"pass shard_for_rank's RankShard, got {shard!r}")
    if not isinstance(like, torch.Tensor) or like.dim() != 3:
        raise InvalidBatchError(
            "like", f"pass the global q [tokens, heads, D], got {_shape_of(like)}"
        )
    _check_int("v_head_dim", v_head_dim, 1)
    heads = like.shape[1]
    rows = int(shard.rows.numel())
    if (out is None) != (lse is None):
        raise InvalidBatchError("lse", "pass out and lse together, or neither (no local rows)")
    if out is not None and lse is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, heads, v_head_dim):
            raise InvalidBatchError(
                "out",
                f"must be [{rows}, {heads}, {v_head_dim}] (the shard's rows), got {_shape_of(out)}",
            )
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (rows, heads):
            raise InvalidBatchError(
                "lse", f"must be [{rows}, {heads}] (the shard's rows), got {_shape_of(lse)}"
            )
    full_out = like.new_zeros((shard.num_tokens, heads, v_head_dim))
    full_lse = torch.full(
        (shard.num_tokens, heads), float("-inf"), dtype=torch.float32, device=like.device
    )
    if out is not None and lse is not None and shard.rows.numel():
        rows = shard.rows.to(like.device)
        full_out[rows] = out
        full_lse[rows] = lse
    return full_out, full_lse


def _shape_of(value: object) -> str:
    shape = getattr(value, "shape", None)
    if shape is None:
        return type(value).__name__
    return f"{tuple(shape)} {getattr(value, 'dtype', '')}".strip()
