"""What a backend provides: the one place a backend author reads. No torch here.

Every member the core (``bind``, ``attn_scope``, ``attention``) or ``cuda_graph`` may use is
declared on ``AttentionBackend`` below, with its exact signature; nothing else is ever looked
up on a backend object. ``BackendBase`` gives the defaults of the optional members, so a
backend defines only ``name``, ``plan`` and ``handler``:

>>> from attn_dispatch.backend import Capabilities, Registry
>>> class MyPlan(PlanBase):
...     pass
>>> class MyBackend(BackendBase):
...     name = "mine"
...     def __init__(self, config, **options): self.config = config
...     def plan(self, batch): return issue_plan(self, MyPlan())  # once per forward, on the host
...     def handler(self, phase): return self.run                 # once per phase, at bind
...     def run(self, q, k_cache, v_cache, plan, sm_scale):
...         check_plan(plan, self, self.name)
...         return q
>>> registry = Registry(plugins=False)           # register_backend(...): the default registry
>>> caps = Capabilities(kinds={"mha"})
>>> registry.register("mine", capabilities=caps, factory=MyBackend) is MyBackend
True

What a backend *can serve* (kinds, dtypes, forms, whether it fixes the scale when it plans)
is declared apart from the object, in its ``Capabilities`` and its registry entry
(``form_policy``), so ``bind`` checks all of it before any factory runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any
from typing import Protocol
from typing import TypeVar
from typing import runtime_checkable

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._phase import Phase

#: The optional attribute of a handler naming its variant for calls the core checked (see
#: ``Handler``).
CORE_CHECKED = "attn_dispatch_core_checked"


class Handler(Protocol):
    """One phase's kernel: ``handler(q, k_cache, v_cache, plan, sm_scale) -> out``.

    ``plan`` is what the same backend object's ``plan(batch)`` returned for this forward;
    ``sm_scale`` is the resolved float (the call's, else the config's). The handler runs once
    per layer: it must not plan again, allocate per-layer metadata or sync the host.

    Per-call extras come as keywords, and only those that apply to the bound config, checked
    by the core first (``attn_dispatch._calls``): ``sinks=`` (a contiguous float32
    ``[num_q_heads]`` tensor on q's device) when ``config.sinks``; ``k_scale=`` (and, for MHA,
    ``v_scale=``) as Python floats in float32's normal range when ``config.kv_dtype`` is FP8;
    ``return_lse=True`` when a call of a ``return_lse=True`` config asks for the attention
    state: the handler then returns ``(out, lse)``, lse float32 ``[tokens, num_q_heads]`` on
    q's device, contiguous (docs/guides/lse-cascade.md); ``out=`` (the caller's output
    buffer: contiguous ``[tokens, num_q_heads, v_head_dim]``, q's dtype and device, sharing no
    memory with q or the caches) when the call gave one and the backend declares
    ``Capabilities.out_buffer``: the handler writes the result there and returns ``out``
    itself (``(out, lse)`` with ``return_lse=True``). A config without them gets the plain
    positional call. The window and the logit cap are read from the config when planning,
    never per call. A backend that declares ``"sinks"``, ``"lse"``, an FP8 ``kv_dtype`` or
    ``out_buffer`` accepts those keyword-only arguments (the ``MHA_CHUNKED`` handler too,
    after its 6th positional ``prefix``, except ``out``, which it never receives): ``bind``
    reads the handler's signature and refuses one without them for a config that needs them
    (``BackendUnavailableError``).

    Optional: a handler of an ``out_buffer`` backend may carry, as its attribute
    ``attn_dispatch_core_checked``, a callable of the same signature that the core
    calls instead for a call with ``out=`` it has checked itself just before (the scale, the
    keywords and the buffer, by the rules above, on the very objects it passes). It may skip
    those checks of its own (a handler called without a binding still needs them), never any
    other (the plan, the tensors against the plan).
    """

    def __call__(
        self, q: Any, k_cache: Any, v_cache: Any, plan: Any, sm_scale: float, /
    ) -> Any: ...


class ChunkedHandler(Protocol):
    """The ``AttnForm.MHA_CHUNKED`` kernel of MLA layers:
    ``run(q, k_new, v_new, batch, sm_scale, prefix) -> out``.

    ``q``/``k_new``/``v_new`` are ragged ``[T, H, D]`` rows of the new tokens; ``prefix``
    yields ``(k_chunk, v_chunk, indptr)`` (see ``attn_dispatch.mla.latent_prefix_chunks``).
    """

    def __call__(
        self,
        q: Any,
        k_new: Any,
        v_new: Any,
        batch: Any,
        sm_scale: float,
        prefix: Iterable[Any],
        /,
    ) -> Any: ...


#: ``update_plan(plan, batch) -> None``: re-plan ``batch`` into a CUDA-graph-captured plan.
UpdatePlan = Callable[[Any, Any], None]


@runtime_checkable
class AttentionBackend(Protocol):
    """A backend object, built by a registered factory at ``bind`` (one per runner and name).

    Required:

    - ``name``: the backend's name (for messages).
    - ``plan(batch) -> plan``: once per forward, on the host, before the layers. The plan is
      immutable once returned and belongs to this object: its handlers may refuse any other.
    - ``handler(phase) -> Handler``: once per phase, at ``bind``; the per-layer callable.

    With defaults in ``BackendBase``:

    - ``chunked_handler(phase) -> ChunkedHandler``: called by ``bind`` only when the
      backend's ``Capabilities.forms`` declare ``"mha_chunked"`` for ``phase``.
    - ``update_plan``: ``None``, or ``update_plan(plan, batch) -> None``, which re-plans the
      batch already copied into a captured plan's buffers (``cuda_graph`` calls it on replay
      instead of copying a fresh plan field by field).
    - ``plans_in_place``: ``True`` when ``plan(batch)`` refills persistent buffers that every
      plan shares (FlashInfer's ``use_cuda_graph`` wrappers), so planning alone updates a
      captured graph.
    """

    @property
    def name(self) -> str: ...

    @property
    def plans_in_place(self) -> bool: ...

    @property
    def update_plan(self) -> UpdatePlan | None: ...

    def plan(self, batch: Any) -> Any: ...

    def handler(self, phase: Phase) -> Handler: ...

    def chunked_handler(self, phase: Phase) -> ChunkedHandler: ...


class BackendBase:
    """Defaults for the optional members of ``AttentionBackend``; subclass it.

    A subclass defines ``name``, ``plan`` and ``handler``; it overrides ``chunked_handler``
    if its capabilities declare the ``"mha_chunked"`` form, defines an ``update_plan`` method
    if it can re-plan into captured buffers, and sets ``plans_in_place = True`` if its
    ``plan`` refills persistent buffers.
    """

    name: str = "unnamed"
    plans_in_place: bool = False
    update_plan: UpdatePlan | None = None

    def plan(self, batch: Any) -> Any:
        raise NotImplementedError(f"backend {self.name!r} defines no plan(batch)")

    def handler(self, phase: Phase) -> Handler:
        raise NotImplementedError(f"backend {self.name!r} defines no handler(phase)")

    def chunked_handler(self, phase: Phase) -> ChunkedHandler:
        raise NotImplementedError(
            f"backend {self.name!r} has no chunked_handler: do not declare the 'mha_chunked' "
            "form in its Capabilities.forms, or override chunked_handler"
        )


#: The members ``bind`` checks on a built backend object (see ``AttentionBackend``).
MEMBERS = ("name", "plan", "handler", "chunked_handler", "update_plan", "plans_in_place")


class PlanBase:
    """Base class of a backend's plan type: a plan is accepted by identity, never by value.

    A plan is an immutable record (a frozen slotted dataclass, say) of one forward. Its
    backend hands it out through ``issue_plan(self, plan)`` and every handler starts with
    ``check_plan(plan, self, name)``: only the very object its backend object issued passes.
    A copy made by ``dataclasses.replace`` (any field changed or not) was never issued, so it
    is refused; ``copy.copy``, ``copy.deepcopy`` and pickling refuse at once. A copyable
    ``owner`` field cannot give that: the copy carries it.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True, slots=True, eq=False)
    ... class MyPlan(PlanBase):
    ...     num_tokens: int
    >>> backend = object()                                 # the backend object (its self)
    >>> plan = issue_plan(backend, MyPlan(num_tokens=3))   # in backend.plan(batch)
    >>> check_plan(plan, backend, "mine")                  # in the handler
    >>> check_plan(dataclasses.replace(plan), backend, "mine")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attn_dispatch.InvalidBatchError: ...
    """

    # The weak reference the issue registry holds (a slotted subclass inherits the slot).
    __slots__ = ("__weakref__",)

    def __copy__(self) -> Any:
        raise _copy_refused(self)

    def __deepcopy__(self, memo: Any) -> Any:
        raise _copy_refused(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _copy_refused(self)


def _copy_refused(plan: object) -> InvalidBatchError:
    return InvalidBatchError(
        "plan",
        f"a {type(plan).__name__} cannot be copied or pickled: a handler accepts only the plan "
        "object its backend made; plan the batch again (binding.plan(batch)) instead",
    )


# id(plan) -> (weak reference to the plan, the backend object that issued it). Entries leave
# with their plan (the weak reference's callback), so an id reused by a later object never
# matches: the reference no longer returns that object.
_ISSUED: dict[int, tuple[weakref.ref[Any], object]] = {}
_ISSUE_LOCK = threading.Lock()
_P = TypeVar("_P")


def issue_plan(owner: object, plan: _P) -> _P:
    """Record ``plan`` as made by the backend object ``owner`` and return it (see
    ``PlanBase``). ``plan`` must be weak-referenceable: subclass ``PlanBase``."""
    key = id(plan)

    def forget(ref: weakref.ref[Any], key: int = key) -> None:
        with _ISSUE_LOCK:
            if _ISSUED.get(key, (None,))[0] is ref:
                del _ISSUED[key]

    try:
        ref = weakref.ref(plan, forget)
    except TypeError:
        raise TypeError(
            f"{type(plan).__name__} cannot be issued as a plan: it holds no weak reference "
            "slot; derive it from attn_dispatch.backend.PlanBase"
        ) from None
    with _ISSUE_LOCK:
        _ISSUED[key] = (ref, owner)
    return plan


def check_plan(plan: Any, owner: object, backend: str) -> None:
    """Refuse (``InvalidBatchError``, field ``plan``) anything but a plan ``owner`` issued.

    One dict lookup and two identity tests. A plan made by another binding's backend, or for
    another config (page size, heads, dims), would make a kernel read with the wrong
    geometry; a copy with a field replaced could name rows outside the tensors.
    """
    entry = _ISSUED.get(id(plan))
    if entry is not None and entry[1] is owner and entry[0]() is plan:
        return
    if entry is None or entry[0]() is not plan:
        made = (
            "is a copy of a plan or was never issued by a backend (plans are accepted by "
            "identity: dataclasses.replace, copy and hand-built plans are refused)"
        )
    else:
        made = f"was made by another {type(entry[1]).__name__} object"
    raise InvalidBatchError(
        "plan",
        f"{backend}: this plan ({type(plan).__name__}) {made}, not by the backend of this "
        "handler; pass the plan of the same binding (binding.plan(batch) / the active "
        "attn_scope), never one from another runner",
    )
