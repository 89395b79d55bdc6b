"""What a backend provides: the one place a backend author reads. No torch here.

Every member the core (``bind``, ``attn_scope``, ``attention``) or ``cuda_graph`` may use is
declared on ``AttentionBackend`` below, with its exact signature; nothing else is ever looked
up on a backend object. ``BackendBase`` gives the defaults of the optional members, so a
backend defines only ``name``, ``plan`` and ``handler``:

>>> class MyBackend(BackendBase):
...     name = "mine"
...     def __init__(self, config, **options): self.config = config
...     def plan(self, batch): return MyPlan(batch)          # once per forward, on the host
...     def handler(self, phase): return my_kernel           # once per phase, at bind
>>> register_backend("mine", capabilities=Capabilities(kinds={"mha"}), factory=MyBackend)

What a backend *can serve* (kinds, dtypes, forms, whether it fixes the scale when it plans)
is declared apart from the object, in its ``Capabilities`` and its registry entry
(``form_policy``), so ``bind`` checks all of it before any factory runs.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from attn_dispatch._phase import Phase

if TYPE_CHECKING:
    from attn_dispatch._binding import Binding


class Handler(Protocol):
    """One phase's kernel: ``handler(q, k_cache, v_cache, plan, sm_scale) -> out``.

    ``plan`` is what the same backend object's ``plan(batch)`` returned for this forward;
    ``sm_scale`` is the resolved float (the call's, else the config's). The handler runs once
    per layer: it must not plan again, allocate per-layer metadata or sync the host.

    Per-call extras come as keywords, and only those that apply to the bound config:
    ``sinks=`` (the tensor as given; the handler checks it is float32 ``[num_q_heads]`` on
    q's device) when ``config.sinks``; ``k_scale=`` (and, for MHA, ``v_scale=``) as Python
    floats > 0 when ``config.kv_dtype`` is FP8. A config without them gets the plain positional
    call. The window and the logit cap are read from the config when planning, never per call.
    A backend that declares ``"sinks"`` or an FP8 ``kv_dtype`` accepts those keyword-only
    arguments (the ``MHA_CHUNKED`` handler too, after its 6th positional ``prefix``).
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


@runtime_checkable
class Runner(Protocol):
    """Anything that owns a ``Binding``: a model runner, a draft worker, a wrapper."""

    @property
    def attn_binding(self) -> Binding: ...
