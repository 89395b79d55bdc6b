"""``PrivatePlans``: what a backend's issued plans stand for, kept by the backend, not in them.

The one rule every backend follows: a plan is a value the backend can trust or refuse. A
frozen dataclass does not give that in Python (``object.__setattr__`` replaces any field, and
a tensor it holds can be edited in place), so a backend built on this table hands out a
*handle*: a ``PlanBase`` whose fields are plain immutable summaries (ints, tuples, a
``Phase``) for display and tests. What the handler reads -- the batch snapshot, page lists,
masks, launch grids -- stays in the backend object's own table, keyed by the handle, where
nothing reachable from the handle leads. Editing a handle's fields changes nothing a kernel
reads; a handle the backend did not issue is refused (``check_plan``). Public as
``attn_dispatch.backend.PrivatePlans``.

>>> import dataclasses
>>> from attn_dispatch.backend import PlanBase
>>> @dataclasses.dataclass(frozen=True, slots=True, eq=False)
... class Handle(PlanBase):
...     num_tokens: int
>>> class Backend:
...     def __init__(self): self.plans = PrivatePlans("mine")
>>> be = Backend()
>>> plan = be.plans.issue(be, Handle(3), {"pages": [4, 5]})   # in plan(batch)
>>> be.plans.get(plan, be)                                     # in the handler
{'pages': [4, 5]}
"""

from __future__ import annotations

import weakref
from typing import Any
from typing import Generic
from typing import TypeVar

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan

__all__ = ["PrivatePlans"]

_T = TypeVar("_T")
_H = TypeVar("_H")


class PrivatePlans(Generic[_T]):
    """One backend object's table: issued handle -> the private record its handler reads.

    A plan is a value the backend must be able to trust: hand out a handle of immutable
    summaries and keep what the kernels read here, where no edit of the handle reaches it.
    ``issue`` in ``plan(batch)``, ``get`` first thing in the handler (it refuses a plan this
    backend object did not issue, as ``check_plan`` does). Entries leave with their handle
    (weak keys), so the table never outlives a plan.

    >>> import dataclasses
    >>> from attn_dispatch.backend import PlanBase, PrivatePlans
    >>> @dataclasses.dataclass(frozen=True, slots=True, eq=False)
    ... class Handle(PlanBase):
    ...     num_tokens: int
    >>> class Mine:
    ...     def __init__(self): self.plans = PrivatePlans("mine")
    >>> be = Mine()
    >>> plan = be.plans.issue(be, Handle(3), {"pages": [4, 5]})   # in plan(batch)
    >>> be.plans.get(plan, be)                                     # in the handler
    {'pages': [4, 5]}
    >>> be.plans.get(Handle(3), be)                                # not issued: refused
    Traceback (most recent call last):
    ...
    attn_dispatch.InvalidBatchError: ...
    """

    __slots__ = ("_held", "backend")

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._held: weakref.WeakKeyDictionary[Any, _T] = weakref.WeakKeyDictionary()

    def issue(self, owner: object, handle: _H, private: _T) -> _H:
        """Record ``private`` for ``handle`` and issue the handle as ``owner``'s plan."""
        self._held[handle] = private
        return issue_plan(owner, handle)

    def get(self, plan: Any, owner: object) -> _T:
        """The private record of ``plan``, or ``InvalidBatchError`` (field ``plan``) when
        ``owner`` did not issue it through this table."""
        check_plan(plan, owner, self.backend)
        try:
            return self._held[plan]
        except (KeyError, TypeError):
            raise InvalidBatchError(
                "plan",
                f"{self.backend}: this plan was issued without its private record; plan the "
                "batch again with this backend's plan(batch)",
            ) from None

    def replace(self, plan: Any, owner: object, private: _T) -> None:
        """Give an issued ``plan`` a new record (a CUDA-graph replay re-planning in place)."""
        self.get(plan, owner)
        self._held[plan] = private
