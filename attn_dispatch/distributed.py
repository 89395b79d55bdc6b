"""Attention across processes: ranks that agree at bind, and context-parallel attention.

Two tools for serving beyond one process (needs torch; ``torch.distributed`` only where a
process group is used):

- ``check_agreement(bindings, group=None)``: run once at start-up on every rank of a process
  group, after each rank bound its runners. Every rank sends a summary of its bindings (spec
  per runner label, the config of each layer group with the per-rank head counts left out,
  page size, KV dtype and scales kind, library version, each backend's build) to every rank;
  if any field differs, *every* rank raises ``RankMismatchError`` naming each rank's value of
  each differing field. Ranks that disagree about a kernel or a KV layout otherwise corrupt
  output silently or crash on the first request (vLLM 46204, 51756; SGLang 31968).
- Context parallelism: each rank holds part of every request's KV tokens
  (``owned_positions``: a contiguous split, or vLLM's interleaved decode-context-parallel
  layout), runs ``attention(..., return_lse=True)`` over its part (``local_verify_mask``
  keeps verify causal by global position), and ``merge_ranks`` all-gathers the states and
  merges them with ``merge_states``: attention over every key. The LSE is the natural log
  (``LSE_BASE``), which is what ``merge_states`` and vLLM's ``is_lse_base_on_e`` expect.

>>> owned_positions(10, rank=1, world=2, layout="interleaved")
[1, 3, 5, 7, 9]
>>> owned_positions(10, rank=1, world=2, layout="contiguous")
[5, 6, 7, 8, 9]
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase

if TYPE_CHECKING:
    import torch

    from attn_dispatch._binding import Binding

__all__ = [
    "LSE_BASE",
    "RankMismatchError",
    "RankShard",
    "binding_summary",
    "check_agreement",
    "compare_summaries",
    "expand_state",
    "local_verify_mask",
    "merge_ranks",
    "owned_positions",
    "shard_for_rank",
]

#: The base of every log-sum-exp attn_dispatch returns: e (natural log).
LSE_BASE = "e"

Layout = Literal["contiguous", "interleaved"]

# Config fields that legitimately differ between ranks of one tensor-parallel group: each
# rank holds its own slice of the heads.
_PER_RANK_FIELDS = frozenset({"num_q_heads", "num_kv_heads"})


class RankMismatchError(AttnDispatchError, RuntimeError):
    """Ranks of one process group bound runners that cannot work together.

    ``differences`` maps ``"<runner>.<field>"`` to the value each rank holds (rank order).
    """

    def __init__(self, differences: Mapping[str, Sequence[Any]], world: int) -> None:
        self.differences = dict(differences)
        self.world = world
        lines = []
        for key, values in self.differences.items():
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            lines.append(f"  {key}: {per_rank}")
        super().__init__(
            f"the {world} ranks of this process group bound runners that disagree on "
            f"{len(self.differences)} field(s):\n" + "\n".join(lines) + "\nEvery rank must bind "
            "the same spec per runner label, configs equal up to the per-rank head split, and "
            "the same attn_dispatch build; fix the rank(s) whose value differs and restart."
        )


def _config_summary(config: Any) -> dict[str, Any]:
    fields = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in _PER_RANK_FIELDS
    }
    # What each rank needs to agree on about the KV cache, said once.
    fields["kv_scales"] = "per-layer float" if getattr(config, "kv_fp8", False) else None
    fields["kv_layout"] = "NHD"
    # Each rank has its own device index (cuda:0, cuda:1): only the device type must agree.
    fields["device"] = str(fields["device"]).split(":")[0]
    return fields


def _kv_summary(config: Any) -> dict[str, Any]:
    # The KV layout descriptor (attn_dispatch.kv_layout), with the per-rank head count left
    # out: the page bytes are compared per KV head instead.
    from attn_dispatch.kv_layout import kv_layout

    layout = kv_layout(config).to_dict()
    heads = layout.pop("num_kv_heads")
    layout["bytes_per_page_per_kv_head"] = layout.pop("bytes_per_page") // heads
    return layout


def _one_binding(b: Binding) -> dict[str, Any]:
    # The spec's ``note`` is compared too: a spec from a dispatch table names the table's
    # fingerprint there, so ranks that loaded different tables disagree.
    return {
        "spec": b.spec.to_dict(),
        "config": _config_summary(b.config),
        "kv_layout": _kv_summary(b.config),
        "backends": {p.name.lower(): b.backend_name(p) for p in Phase},
        # A backend with a compiled part says which build it runs (native: its C ABI
        # version); two ranks with different builds must not serve one model together.
        "builds": {
            name: getattr(obj, "abi_version", None) for name, obj in sorted(b.backends.items())
        },
    }


def binding_summary(bindings: Binding | Mapping[str, Binding]) -> dict[str, Any]:
    """What one rank's bindings must agree on with every other rank (JSON-able).

    ``bindings`` is one ``Binding`` (summarised under its label, or ``""``) or a mapping of
    runner label to ``Binding``.
    """
    from attn_dispatch._binding import Binding
    from attn_dispatch._version import __version__

    if isinstance(bindings, Binding):
        runners: Mapping[str, Binding] = {bindings.label or "": bindings}
    elif isinstance(bindings, Mapping):
        runners = bindings
    else:
        raise InvalidBatchError(
            "bindings",
            f"got {type(bindings).__name__}; pass a Binding or a mapping of runner label to "
            "Binding",
        )
    out: dict[str, Any] = {"library": {"version": __version__}}
    for label in sorted(runners):
        b = runners[label]
        if not isinstance(b, Binding):
            raise InvalidBatchError(
                f"bindings[{label!r}]", f"got {type(b).__name__}; pass the Binding of that runner"
            )
        if b.groups:
            out[f"runner {label!r}"] = {
                f"group {g!r}": _one_binding(gb) for g, gb in sorted(b.groups.items())
            }
        else:
            out[f"runner {label!r}"] = _one_binding(b)
    # One canonical form for the wire and the comparison.
    return json.loads(json.dumps(out, sort_keys=True, default=str))  # type: ignore[no-any-return]


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(f"{prefix}.{k}" if prefix else str(k), value[k], into)
    else:
        into[prefix] = value


_MISSING = "<not bound on this rank>"


def compare_summaries(summaries: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Each field whose value differs between the given ranks' summaries, per rank.

    A runner, group or field present on some ranks only is a difference too (the ranks that
    lack it show ``"<not bound on this rank>"``).
    """
    flat = []
    for s in summaries:
        f: dict[str, Any] = {}
        _flatten("", dict(s), f)
        flat.append(f)
    keys = sorted(set().union(*flat)) if flat else []
    diffs: dict[str, list[Any]] = {}
    for key in keys:
        values = [f.get(key, _MISSING) for f in flat]
        if any(v != values[0] for v in values[1:]):
            diffs[key] = values
    return diffs


def check_agreement(bindings: Binding | Mapping[str, Binding], group: Any = None) -> None:
    """Check at start-up that every rank of ``group`` bound compatible runners.

    Call it on every rank (it is a collective: each rank sends its ``binding_summary`` to all
    others with ``torch.distributed.all_gather_object``). ``group=None`` is the default
    process group. Raises ``RankMismatchError`` on every rank when any field differs, naming
    each rank's value; returns None when all agree. Without an initialised process group it
    raises ``AttnDispatchError`` saying so.

    .. code-block:: python

        bindings = {"target": bind(target_spec, target_cfg), "draft": bind(draft_spec, cfg)}
        check_agreement(bindings)  # once, on every rank, after bind
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise _NoGroupError()
    mine = binding_summary(bindings)
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    diffs = compare_summaries(gathered)
    if diffs:
        raise RankMismatchError(diffs, world)


class _NoGroupError(AttnDispatchError, RuntimeError):
    def __init__(self) -> None:
        super().__init__(
            "check_agreement needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) on every rank first (or pass group=)"
        )


# -- context parallelism ------------------------------------------------------------------------


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

    pos = torch.as_tensor(list(owned), dtype=torch.long)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= kv_len):
        raise InvalidBatchError("owned", f"positions must lie in [0, {kv_len}), got {list(owned)}")
    if tree is not None:
        if tuple(tree.shape) != (q_len, kv_len) or tree.dtype != torch.bool:
            raise InvalidBatchError(
                "tree", f"must be bool [{q_len}, {kv_len}], got {tuple(tree.shape)} {tree.dtype}"
            )
        return tree[:, pos].clone()
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

    phase = batch.phase
    if phase is Phase.PREFILL:
        raise InvalidBatchError(
            "phase", "context-parallel sharding serves DECODE and VERIFY batches; got PREFILL"
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

    heads = like.shape[1]
    full_out = like.new_zeros((shard.num_tokens, heads, v_head_dim))
    full_lse = torch.full(
        (shard.num_tokens, heads), float("-inf"), dtype=torch.float32, device=like.device
    )
    if out is not None and lse is not None and shard.rows.numel():
        rows = shard.rows.to(like.device)
        full_out[rows] = out
        full_lse[rows] = lse
    return full_out, full_lse
