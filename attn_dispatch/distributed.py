"""Attention across processes: ranks that agree at bind, and context-parallel attention.

Two tools for serving beyond one process (needs torch; ``torch.distributed`` only where a
process group is used):

- ``check_agreement(bindings, group=None)``: run once at start-up on every rank of a process
  group, after each rank bound its runners. Every rank sends a summary of its bindings (spec
  per runner label, the config of each layer group with the per-rank head counts left out,
  page size, KV dtype and scales kind, library version, each backend's build) to every rank;
  if any field differs, *every* rank raises ``RankMismatchError`` naming each rank's value of
  each differing field. Ranks that disagree about a kernel or a KV layout otherwise corrupt
  output silently or crash on the first request (vLLM 46204, 51756; SGLang 31968). A rank
  that fails on its own input before the exchange still takes part (with a failure marker),
  so no rank waits for it: every rank raises ``RankFailedError`` naming it and why.
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
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._context_parallel import RankShard
from attn_dispatch._context_parallel import expand_state
from attn_dispatch._context_parallel import local_verify_mask
from attn_dispatch._context_parallel import merge_ranks
from attn_dispatch._context_parallel import owned_positions
from attn_dispatch._context_parallel import shard_for_rank
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import NoProcessGroupError as _NoGroupError
from attn_dispatch._errors import RankFailedError
from attn_dispatch._errors import RankMismatchError
from attn_dispatch._phase import Phase

if TYPE_CHECKING:
    from attn_dispatch._binding import Binding

__all__ = [
    "LSE_BASE",
    "RankFailedError",
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

# Config fields that legitimately differ between ranks of one tensor-parallel group: each
# rank holds its own slice of the heads.
_PER_RANK_FIELDS = frozenset({"num_q_heads", "num_kv_heads"})


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

    A rank whose own input cannot be summarised (not a ``Binding``, say) still joins the
    exchange, with a failure marker instead of its summary, so no rank waits for it until the
    process group's timeout (30 minutes for gloo): every rank raises ``RankFailedError``
    naming each failed rank and why (on the failed rank, chained to its own error).

    .. code-block:: python

        bindings = {"target": bind(target_spec, target_cfg), "draft": bind(draft_spec, cfg)}
        check_agreement(bindings)  # once, on every rank, after bind
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise _NoGroupError()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    failure: Exception | None = None
    try:
        mine: dict[str, Any] = binding_summary(bindings)
    except Exception as exc:  # any failure here: the other ranks must still be released
        failure = exc
        why = f"{type(exc).__name__}: {exc}"
        # Bounded: it travels to every rank and into every rank's message.
        mine = {_FAILED: why if len(why) <= _WHY_MAX else why[: _WHY_MAX - 3] + "..."}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    failures = {
        r: str(g[_FAILED]) for r, g in enumerate(gathered) if isinstance(g, dict) and _FAILED in g
    }
    if failures:
        raise RankFailedError(failures, world, rank) from failure
    diffs = compare_summaries(gathered)
    if diffs:
        raise RankMismatchError(diffs, world)


# The key of the failure marker a rank sends instead of its summary (no summary has it: a
# summary's keys are "library" and "runner ..."), so ranks of older versions still compare.
_FAILED = "<failed before the check>"
_WHY_MAX = 2000


RankShard.__module__ = "attn_dispatch.distributed"
