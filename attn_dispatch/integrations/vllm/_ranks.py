"""The vLLM plugin across ranks: agreement of the ranks' bindings at start-up, and what each
worker reports to the caller (``rank_tables``, ``record_ranks``).

Runs in vLLM's worker processes: at start-up from the metadata builders, and through
``LLM.collective_rpc`` (``worker_table``, ``worker_start_recording``,
``worker_stop_recording``). What it keeps is the engine's (``EngineState``).
"""

from __future__ import annotations

from typing import Any

from attn_dispatch._binding import Binding
from attn_dispatch._errors import ScopeError
from attn_dispatch.integrations.vllm._layers import EngineState
from attn_dispatch.integrations.vllm._layers import LayerDispatch
from attn_dispatch.integrations.vllm._layers import engine_state


def tp_group() -> Any:
    """vLLM's tensor-parallel group coordinator, or None outside a distributed engine."""
    from vllm.distributed import parallel_state

    # Untyped in vLLM: read through Any (mypy sees the module only where vLLM is installed).
    state: Any = parallel_state
    if not state.model_parallel_is_initialized():
        return None
    return state.get_tp_group()


def bindings_of_layers(vllm_config: Any, layer_names: Any = None) -> dict[str, Binding]:
    """Runner label (``"target"``, ``"draft"``; ``"target#1"``... when a runner has several
    layer configs) -> ``Binding``, over the attn_dispatch layers named (all when None)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    found: dict[str, list[Binding]] = {}
    for _, layer in sorted(
        get_layers_from_vllm_config(vllm_config, Attention, layer_names).items()
    ):
        d = getattr(layer.impl, "dispatch", None)
        if isinstance(d, LayerDispatch):
            same = found.setdefault(d.label, [])
            if not any(b is d.binding for b in same):
                same.append(d.binding)
    out: dict[str, Binding] = {}
    for label, bindings in sorted(found.items()):
        for i, b in enumerate(sorted(bindings, key=lambda b: repr(b.config))):
            out[label if i == 0 else f"{label}#{i}"] = b
    return out


def agree_across_ranks(bindings: dict[str, Binding], state: EngineState) -> None:
    """``check_agreement`` over vLLM's tensor-parallel group when it has more than one rank;
    what it found goes to the engine's ``state`` (``worker_table`` reports it).

    Run where vLLM builds each KV group's metadata builder (start-up, after every layer of
    the group is bound at its final page size): every rank builds the same groups in the same
    order, so each rank makes the same collective calls. The TP group's CPU (gloo) group
    carries the summaries; a pipeline stage's ranks form their own TP group (stages bind
    different layers, so they are not compared).
    """
    from attn_dispatch.distributed import check_agreement

    tp = tp_group()
    if tp is None or tp.world_size <= 1:
        return
    check_agreement(bindings, group=tp.cpu_group)
    state.agreements.append(
        {"group": "tp", "world": int(tp.world_size), "runners": sorted(bindings), "agreed": True}
    )


def _config_row(one: LayerDispatch) -> dict[str, Any]:
    c = one.config
    return {
        "num_q_heads": c.num_q_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "page_size": c.page_size,
        "dtype": str(c.dtype),
        "kv_dtype": str(c.kv_dtype),
        "return_lse": c.return_lse,
    }


def worker_table(worker: Any) -> dict[str, Any]:
    """One worker's dispatch table (``LLM.collective_rpc`` calls it in every worker).

    JSON-able: ``rank`` (global), ``tp_rank``, ``tp_size``; ``runners``: label -> ``spec``,
    ``table`` (phase -> backend), ``configs`` (the distinct layer configs this rank bound:
    heads per rank, head size, page size, dtypes; ``dcp_configs``: under decode context
    parallel, the decode binding's) and ``layers`` (how many); ``agreement``:
    what ``check_agreement`` found at start-up (empty on a single rank).
    """
    tp = tp_group()
    compilation_config = worker.model_runner.compilation_config
    runners: dict[str, dict[str, Any]] = {}
    for _, layer in sorted(compilation_config.static_forward_context.items()):
        d = getattr(getattr(layer, "impl", None), "dispatch", None)
        if not isinstance(d, LayerDispatch):
            continue
        r = runners.setdefault(
            d.label,
            {
                "spec": str(d.binding.spec),
                "table": dict(d.binding.table()),
                "configs": [],
                "layers": 0,
            },
        )
        r["layers"] += 1
        bound = [("configs", d)]
        dcp = getattr(layer.impl, "dcp_dispatch", None)
        if isinstance(dcp, LayerDispatch):  # decode context parallel's decode binding
            bound.append(("dcp_configs", dcp))
        for key, one in bound:
            cfg = _config_row(one)
            if cfg not in r.setdefault(key, []):
                r[key].append(cfg)
    return {
        "rank": int(getattr(worker, "rank", 0)),
        "tp_rank": 0 if tp is None else int(tp.rank_in_group),
        "tp_size": 1 if tp is None else int(tp.world_size),
        "runners": runners,
        "agreement": list(engine_state(compilation_config).agreements),
    }


def worker_start_recording(worker: Any) -> None:
    """Open a ``record_dispatch`` in this worker (``record_ranks`` calls it in every worker).

    vLLM's workers run every RPC, ``execute_model`` included, on one thread, so the
    recorder opened here sees the steps that follow until ``worker_stop_recording``.
    """
    from attn_dispatch._record import record_dispatch

    state = engine_state(worker.model_runner.compilation_config)
    if state.recording is not None:
        raise ScopeError("record_ranks is already open in this vLLM worker")
    ctx = record_dispatch()
    state.recording = (ctx, ctx.__enter__())


def worker_stop_recording(worker: Any) -> list[list[Any]]:
    """Close this worker's recorder; ``[[label, phase, backend, calls], ...]``."""
    state = engine_state(worker.model_runner.compilation_config)
    if state.recording is None:
        raise ScopeError("record_ranks was not opened in this vLLM worker")
    ctx, rec = state.recording
    state.recording = None
    ctx.__exit__(None, None, None)
    return [[*key, n] for key, n in sorted(rec.counts().items(), key=str)]


__all__ = [
    "agree_across_ranks",
    "bindings_of_layers",
    "tp_group",
    "worker_start_recording",
    "worker_stop_recording",
    "worker_table",
]
