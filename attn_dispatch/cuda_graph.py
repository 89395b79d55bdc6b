"""CUDA graphs that stay correct per runner: resolve before capture.

A captured CUDA graph replays the kernels it saw, with the pointers it saw. Python does not run
on replay, so nothing is dispatched again: whichever runner was active at capture, its backend,
its handler and the plan tensors that handler read are baked into the graph. Hence the rules
this module enforces:

1. Resolve and plan *before* capture. The runner's scope is entered and ``backend.plan`` runs
   outside the captured region (planning copies host data and may allocate: neither may be
   captured). Creating a ``GraphedForward`` while a capture is under way raises
   ``CaptureError``; backends may call ``assert_not_capturing()`` from their ``plan``.
2. Persistent buffers. The batch tensors and every tensor of the plan are allocated once, at
   capture. ``replay(batch)`` plans the new batch on the host and copies the result into those
   same buffers (identical ``data_ptr``); a batch or plan of another shape, or one that differs
   in a value the graph baked in, is refused with ``InvalidBatchError``.
3. One graph per runner and batch shape. The capture records which (runner, phase, backend)
   served each ``attention`` call; a forward that opened another runner's scope inside the
   captured region is refused (that runner's kernels would be replayed for this one).

>>> import torch
>>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, bind
>>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8,
...                     sm_scale=0.25)
>>> class Runner:
...     attn_binding = bind("torch", config, label="target")
>>> def step(q, k_cache, v_cache):          # one decode forward (here: one layer)
...     return attention(q, k_cache, v_cache)
>>> def decode_batch(kv_lens, page_tables):
...     return AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=kv_lens,
...                            page_tables=page_tables, page_size=8)
>>> q, k_cache = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
>>> graphed = capture_decode(Runner(), decode_batch([7, 3], [[0], [2]]), step,
...                          q, k_cache, k_cache, max_pages_per_request=2)
>>> steps = [(decode_batch([8, 4], [[0], [2]]), q), (decode_batch([9, 5], [[0, 1], [2]]), q)]
>>> for batch, q in steps:                  # same number of requests; sequences grow
...     out = graphed.replay(batch, q)      # host plan + copies, then one graph launch
>>> out.shape                               # (off CUDA, replay runs step eagerly)
torch.Size([2, 4, 16])

Growing sequences: with ``max_pages_per_request=C`` every batch (the captured one and each
replayed one) is laid out with exactly ``C`` page-table entries per request (``kv_indptr`` is
``[0, C, 2C, ...]``, pads repeat a request's first page and are never read), so the metadata
shapes stay fixed while ``kv_lens`` grow and requests cross page boundaries, as SGLang and vLLM
capture one decode graph per batch size. A step whose request needs more than ``C`` pages is
refused with ``InvalidBatchError``, leaving the captured buffers as they were. Without it, a
replay needs the captured number of pages per request exactly.

How a new batch reaches the captured buffers, per backend:

- ``update_plan(plan, batch) -> None`` on the backend: it re-plans into the captured plan;
- ``plans_in_place = True`` on the backend: its ``plan(batch)`` refills persistent buffers
  that every plan shares (FlashInfer's ``use_cuda_graph`` wrappers), so planning is enough;
- otherwise the plan must be built of dataclasses, tuples, lists, dicts, tensors and plain
  values, which are copied or compared field by field; a plan holding any other object (a
  wrapper whose buffers may move) is refused at capture with ``CaptureError``.

On CPU there is no graph: ``GraphedForward`` runs ``fn`` again on each replay, under the
captured plan and buffers, so the plan/run split and buffer reuse can be tested anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._errors import CaptureError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase
from attn_dispatch._record import DispatchEvent
from attn_dispatch._record import record_dispatch
from attn_dispatch._record import record_events
from attn_dispatch._route import Binding
from attn_dispatch._scope import attn_scope
from attn_dispatch._snapshot import BatchSnapshot
from attn_dispatch._snapshot import StepStats
from attn_dispatch._values import as_int

__all__ = ["CaptureError", "GraphedForward", "assert_not_capturing", "capture_decode"]

# Host-side planning statistics of an AttnBatch: they may change between replays of one shape
# (a decode step's longest sequence grows), so a handler run inside a graph must not read them.
_BATCH_STATS = frozenset({"max_q_len", "max_kv_len", "num_pages"})
# Plan fields that are identities, not values: the backend object that made a plan (the same
# for every plan of one binding), and a backend's token for "the plan its wrapper holds now"
# (FlashInfer: a new one per plan, refilled into the same persistent buffers in graph mode).
_IDENTITIES = frozenset({"owner", "ticket"})
# A snapshot's per-step counts (_snapshot.StepStats): followed on replay, not compared.
_PLAIN_STEP = (StepStats,)


def assert_not_capturing(what: str = "plan") -> None:
    """Raise ``CaptureError`` when the current CUDA stream is capturing a graph.

    Backends call it at the top of ``plan``: a plan made inside a captured region would be
    baked into the graph and never run again.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise CaptureError(
            f"{what} called while a CUDA graph is being captured; resolve and plan before "
            "capture: enter attn_scope(runner, batch) (or build a GraphedForward) outside "
            "torch.cuda.graph(...), and replay new batches with GraphedForward.replay"
        )


def _binding_of(runner: object) -> Binding:
    binding = getattr(runner, "attn_binding", None)
    if not isinstance(binding, Binding):
        raise CaptureError(
            f"a graph is captured for one runner: pass a Binding or an object whose "
            f"attn_binding is one (got {type(runner).__name__})"
        )
    return binding


def _copy_into(dst: Any, src: Any, path: str, seen: set[int], write: bool = True) -> None:
    """Copy ``src`` into the persistent ``dst`` (same structure and shapes) or raise.

    ``write=False`` only checks, so a refused batch leaves the buffers as they were.
    """
    if dst is src or id(dst) in seen:
        return
    seen.add(id(dst))
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor):
            raise InvalidBatchError(path, f"expected a tensor like the captured one, got {src!r}")
        if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device:
            raise InvalidBatchError(
                path,
                f"{tuple(src.shape)} {src.dtype} on {src.device} != captured "
                f"{tuple(dst.shape)} {dst.dtype} on {dst.device}: a captured graph replays one "
                "batch shape; capture a GraphedForward per shape, pad the batch to a captured "
                "shape, or run this batch eagerly",
            )
        if write:
            dst.copy_(src, non_blocking=True)
        return
    if dataclasses.is_dataclass(dst) and not isinstance(dst, type):
        if type(src) is not type(dst):
            raise InvalidBatchError(path, f"{type(src).__name__} != captured {type(dst).__name__}")
        skip = _BATCH_STATS if isinstance(dst, AttnBatch) else frozenset()
        if isinstance(dst, BatchSnapshot):
            # The captured plan's own snapshot follows the step: the per-call checks compare
            # the cache with its max_page, and the counts may change between replays.
            skip = frozenset({"step"})
            if write:
                assert isinstance(src, BatchSnapshot)  # same type, checked above
                dst.step.follow(src.step)
        for f in dataclasses.fields(dst):
            if f.name not in skip and f.name not in _IDENTITIES:
                _copy_into(
                    getattr(dst, f.name), getattr(src, f.name), f"{path}.{f.name}", seen, write
                )
        return
    if isinstance(dst, (tuple, list)):
        if type(src) is not type(dst) or len(src) != len(dst):
            raise InvalidBatchError(path, f"{_short(src)} does not match captured {_short(dst)}")
        for i, (d, s) in enumerate(zip(dst, src, strict=True)):
            _copy_into(d, s, f"{path}[{i}]", seen, write)
        return
    if isinstance(dst, dict):
        if not isinstance(src, dict) or src.keys() != dst.keys():
            raise InvalidBatchError(path, f"keys {sorted(map(str, src))} != captured keys")
        for key in dst:
            _copy_into(dst[key], src[key], f"{path}[{key!r}]", seen, write)
        return
    try:
        same = bool(dst == src)
    except Exception:
        same = False
    if not same:
        raise InvalidBatchError(
            path,
            f"{_short(src)} != captured {_short(dst)}: the captured graph baked this value in; "
            "capture a GraphedForward for this batch shape, or give the backend an "
            "update_plan(plan, batch) method that re-plans into the captured buffers",
        )


_PLAIN = (int, float, bool, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)


def _opaque_paths(obj: Any, path: str, seen: set[int]) -> Iterator[str]:
    """Paths of plan members that ``_copy_into`` cannot copy or compare by value (a kernel
    library's wrapper object, say): their buffers may move on the next plan.
    A plan's ``owner`` and ``ticket`` are identities (see ``_IDENTITIES``), never copied."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, *_PLAIN, *_PLAIN_STEP)):
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name in _IDENTITIES:
                continue
            yield from _opaque_paths(getattr(obj, f.name), f"{path}.{f.name}", seen)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _opaque_paths(item, f"{path}[{i}]", seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _opaque_paths(item, f"{path}[{key!r}]", seen)
    else:
        yield f"{path} ({type(obj).__name__})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _persistent_batch(batch: AttnBatch) -> AttnBatch:
    # Fresh buffers owned by the graph: the caller may reuse or free its own batch tensors.
    clones: dict[int, Any] = {}
    fresh: dict[str, Any] = {}
    for f in dataclasses.fields(AttnBatch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            fresh[f.name] = clones.setdefault(id(value), value.clone())
    return batch._derive(**fresh)


def _to_capacity(batch: AttnBatch, capacity: int, page_size: int) -> AttnBatch:
    """``batch`` with every request's page table padded (or trimmed) to ``capacity`` entries.

    A captured graph reads metadata of fixed shapes, but a decode step's page tables grow as
    sequences cross page boundaries. In this layout ``kv_indptr`` is ``[0, C, 2C, ...]`` and
    ``kv_indices`` has ``B * C`` entries at every step, so one graph serves every step until a
    request needs more than ``C`` pages. Pads repeat the request's first page: in range, and
    never read (they lie past ``kv_len``). Host copies only; the page indices are gathered on
    the batch's device (no host sync). Raises ``InvalidBatchError`` past the capacity.
    """
    import torch

    kv = batch.kv_indptr_host.tolist()
    lens = batch.kv_lens_host.tolist()
    b = len(lens)
    positions: list[int] = []
    for i in range(b):
        have = kv[i + 1] - kv[i]
        need = -(-lens[i] // page_size)
        if need > capacity or have < need:
            raise InvalidBatchError(
                "kv_indptr",
                f"kv_len {lens[i]} needs {need} pages of {page_size} tokens, the graph was "
                f"captured for at most {capacity} pages per request (and the batch gives "
                f"{have}); capture with a larger max_pages_per_request or run this step eagerly",
                request=i,
            )
        first = kv[i]
        positions.extend(first + min(j, max(have - 1, 0)) for j in range(capacity))
    dev = batch.kv_indices.device
    if positions:
        where = torch.tensor(positions, dtype=torch.int64)
        if dev.type != "cpu":  # pinned: a pageable copy would wait for the device's queue
            where = where.pin_memory().to(dev, non_blocking=True)
        indices = batch.kv_indices.index_select(0, where)
    else:
        indices = torch.zeros(0, dtype=torch.int32, device=dev)
    kv_host = torch.arange(0, (b + 1) * capacity, capacity, dtype=torch.int32)[: b + 1]
    # The fields a plan reads, replaced; the batch was validated when built and every backend
    # checks its own copy again when it plans.
    return batch._derive(
        kv_indices=indices.contiguous(),
        kv_indptr_host=kv_host,
        kv_indptr=kv_host if dev.type == "cpu" else kv_host.pin_memory().to(dev, non_blocking=True),
        page_size=page_size,
    )


def _check_page_size(batch: AttnBatch, bound: int) -> None:
    if batch.page_size is not None and batch.page_size != bound:
        raise InvalidBatchError(
            "page_size",
            f"batch page_size {batch.page_size!r} != bound config page_size {bound!r}; build the "
            "batch for the page size of the runner the graph was captured for",
        )


class GraphedForward:
    """``fn(*inputs)`` of one runner captured for one batch shape; ``replay`` new batches.

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, bind
    >>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8,
    ...                     sm_scale=0.25)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> def step(q, k_cache, v_cache):          # one decode forward (here: one layer)
    ...     return attention(q, k_cache, v_cache)
    >>> def decode_batch(kv_lens, page_tables):
    ...     return AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=kv_lens,
    ...                            page_tables=page_tables, page_size=8)
    >>> q, k_cache = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
    >>> graphed = GraphedForward(Runner(), decode_batch([7, 3], [[0], [2]]), step,
    ...                          q, k_cache, k_cache)
    >>> next_batch, next_q = decode_batch([8, 4], [[1], [3]]), torch.randn(2, 4, 16)
    >>> out = graphed.replay(next_batch, next_q)   # k_cache, v_cache: the captured ones

    The runner's backend plans ``batch`` outside the captured region; ``fn`` runs under that
    plan. The tensors among ``inputs`` become the graph's static inputs: ``replay`` copies any
    new tensor given in their place into them (passing the same tensor costs nothing), and on
    CUDA returns the graph's static output, overwritten by the next replay (clone to keep it).
    ``capture=False`` (the default off CUDA) runs ``fn`` eagerly on each replay instead.
    ``pool`` shares a memory pool between graphs (``torch.cuda.graph_pool_handle()``).
    """

    def __init__(
        self,
        runner: object,
        batch: AttnBatch,
        fn: Callable[..., Any],
        *inputs: Any,
        capture: bool | None = None,
        warmup: int = 2,
        pool: Any = None,
        max_pages_per_request: int | None = None,
    ) -> None:
        assert_not_capturing("GraphedForward (which plans)")
        if not isinstance(batch, AttnBatch):
            raise InvalidBatchError("batch", f"expected an AttnBatch, got {type(batch).__name__}")
        self.binding = _binding_of(runner)
        if max_pages_per_request is not None:
            max_pages_per_request = as_int(max_pages_per_request, "max_pages_per_request", low=1)
        self.capacity = max_pages_per_request
        self._page_size = int(self.binding.config.page_size)
        _check_page_size(batch, self._page_size)
        if self.capacity is not None:
            batch = _to_capacity(batch, self.capacity, self._page_size)
        self.phase: Phase = batch.phase
        self.fn = fn
        self.inputs = inputs
        self.capture = batch.device.type == "cuda" if capture is None else capture
        if self.capture and batch.device.type != "cuda":
            raise CaptureError(f"capture=True needs a CUDA batch, got one on {batch.device}")
        # Rule 1: resolve and plan here, before any capture (what attn_scope does on entry).
        self.batch = _persistent_batch(batch)
        # Shape buckets: the graph replays the kernels of the bucket it was captured in.
        self._bucketed = self.binding if self.binding.bucketed else None
        self.binding = self.binding.for_batch(self.batch)
        self.plan, self.run, self.form = self.binding.prepare(self.batch)
        # A backend's own in-place re-plan applies to the phase backend's plan only (the MLA
        # forms that plan on another backend are copied field by field).
        self.backend = self.binding.backend(self.phase)
        plain = self.run is self.binding.handler(self.phase)
        self._update_plan = self.backend.update_plan if plain else None
        if self._update_plan is None and not self.backend.plans_in_place:
            opaque = list(_opaque_paths(self.plan, "plan", set()))
            if opaque:
                raise CaptureError(
                    f"backend {self.binding.backend_name(self.phase)!r} cannot be captured as "
                    f"bound: its plan holds objects attn_dispatch cannot copy into the "
                    f"captured buffers ({', '.join(opaque[:4])}), so a replay could read "
                    "stale metadata. A backend whose plan() refills persistent buffers in "
                    "place declares plans_in_place = True (flashinfer: bind it with "
                    "options={'flashinfer': {'use_cuda_graph': True, 'max_num_pages': N}}); "
                    "or it defines update_plan(plan, batch)"
                )
        # The frame attn_scope builds, holding our persistent plan: entering it plans nothing,
        # and it exits with attn_scope's own out-of-order checks.
        self._scope = attn_scope(self.binding, self.batch, (self.plan, self.run, self.form))
        self.graph: Any = None
        self.output: Any = None
        with record_dispatch() as rec:
            if self.capture:
                self._capture(warmup, pool)
            else:
                with self._scope:
                    fn(*inputs)
        self.baked: tuple[DispatchEvent, ...] = tuple(rec.events)
        self._check_baked()

    def _capture(self, warmup: int, pool: Any) -> None:
        # Warm up on a side stream (lazy inits, autotuning) as torch.cuda.graph requires.
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self._scope:
            for _ in range(max(warmup, 0)):
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self._scope, torch.cuda.graph(graph, pool=pool):
            self.output = self.fn(*self.inputs)
        self.graph = graph

    def _check_baked(self) -> None:
        mine = (self.binding.label, self.binding.backend_name(self.phase))
        for event in self.baked:
            if (event.label, event.backend) != mine or event.phase is not self.phase:
                raise CaptureError(
                    f"the captured forward of runner {self.binding.label!r} ({mine[1]!r}, "
                    f"{self.phase.name.lower()}) also called attention for runner "
                    f"{event.label!r} ({event.backend!r}, {event.phase.name.lower()}): a graph "
                    "replays the kernels it saw, so capture one GraphedForward per runner and "
                    "open no other runner's scope inside fn"
                )

    def update(self, batch: AttnBatch) -> None:
        """Plan ``batch`` on the host and copy it into the captured buffers (no launch)."""
        if not isinstance(batch, AttnBatch) or batch.phase is not self.phase:
            got = getattr(batch, "phase", type(batch).__name__)
            raise InvalidBatchError(
                "phase", f"{got!r} != captured {self.phase!r}: capture one graph per phase"
            )
        # What the eager path refuses, refused here too, before the layout below rewrites the
        # batch's page_size (a batch of another page size must never replay).
        _check_page_size(batch, self._page_size)
        if self.capacity is not None:
            batch = _to_capacity(batch, self.capacity, self._page_size)
        if self._bucketed is not None and self._bucketed.for_batch(batch) is not self.binding:
            raise InvalidBatchError(
                "shape",
                f"this batch falls in another shape bucket of runner {self.binding.label!r} "
                f"({self._bucketed.spec.phase_text(self.phase)}) than the captured one "
                f"({self.binding.backend_name(self.phase)!r}): capture one graph per bucket",
            )
        update_plan = self._update_plan
        plan = None
        if update_plan is None:
            plan, run, form = self.binding.prepare(batch)
            if form is not self.form or run is not self.run:
                raise InvalidBatchError(
                    "form",
                    f"the backend chose form {getattr(form, 'value', form)!r} for this batch, "
                    f"the graph was captured with {getattr(self.form, 'value', self.form)!r}: "
                    "capture one graph per form",
                )
        # Check everything first, then write: a refused batch leaves the buffers intact.
        for write in (False, True):
            seen: set[int] = set()
            _copy_into(self.batch, batch, "batch", seen, write)
            if plan is not None:
                _copy_into(self.plan, plan, "plan", seen, write)
        if update_plan is not None:
            update_plan(self.plan, self.batch)

    def replay(self, batch: AttnBatch, *inputs: Any) -> Any:
        """Run the captured forward on ``batch`` (same shape as the captured one).

        ``inputs`` replace the captured inputs position by position (fewer may be given: the
        rest stay as they are).
        """
        if len(inputs) > len(self.inputs):
            raise InvalidBatchError(
                "inputs", f"{len(inputs)} given, the graph was captured with {len(self.inputs)}"
            )
        pairs = list(enumerate(zip(self.inputs, inputs, strict=False)))
        for i, (dst, src) in pairs:
            _copy_into(dst, src, f"inputs[{i}]", set(), write=False)
        self.update(batch)
        for i, (dst, src) in pairs:
            _copy_into(dst, src, f"inputs[{i}]", set())
        if self.graph is None:
            with self._scope:
                return self.fn(*self.inputs)
        self.graph.replay()
        # Replays run no Python: report the kernels the graph baked in.
        record_events(self.baked)
        return self.output

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every persistent tensor (batch and plan): their ``data_ptr`` never changes."""
        seen: set[int] = set()
        stack: list[Any] = [self.batch, self.plan]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                yield obj
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
            elif isinstance(obj, (tuple, list)):
                stack.extend(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())


def capture_decode(
    runner: object, batch: AttnBatch, fn: Callable[..., Any], *inputs: Any, **options: Any
) -> GraphedForward:
    """Capture one decode step of ``runner`` (``GraphedForward`` for a DECODE batch).

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, bind
    >>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8,
    ...                     sm_scale=0.25)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="draft")
    >>> def step(q, k_cache, v_cache):          # one decode forward (here: one layer)
    ...     return attention(q, k_cache, v_cache)
    >>> def decode_batch(kv_lens, page_tables):
    ...     return AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=kv_lens,
    ...                            page_tables=page_tables, page_size=8)
    >>> q, k_cache = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
    >>> graphed = capture_decode(Runner(), decode_batch([7, 3], [[0], [2]]), step,
    ...                          q, k_cache, k_cache, max_pages_per_request=2)
    >>> next_batch, next_q = decode_batch([9, 4], [[0, 1], [2]]), torch.randn(2, 4, 16)
    >>> out = graphed.replay(next_batch, next_q)   # sequences may have grown

    ``max_pages_per_request`` fixes the page-table capacity of the graph (see the module's
    docstring); without it every replay needs the captured pages per request exactly.
    """
    if getattr(batch, "phase", None) is not Phase.DECODE:
        raise InvalidBatchError(
            "phase",
            f"capture_decode needs a DECODE batch, got {getattr(batch, 'phase', None)!r}; "
            "use GraphedForward for other phases",
        )
    return GraphedForward(runner, batch, fn, *inputs, **options)
