"""The cascade (shared-prefix) planner: which requests read their common leading pages once.

Pure Python on host lists (no torch), so it is tested without any kernel library
(``tests/core/test_cascade_plan.py``). FlashInfer's backend plans with it; the native backend
plans in C++ (``csrc/plan.cpp``, ``find_groups``) by the same rule, with the
differences listed below.

The rule, in one wording for every backend:

1. *Shared keys are whole pages that every query of every member sees.* A request offers at
   most ``(kv_len - q_len + 1 - own_keys) // page_size`` leading pages (the keys before its
   first query, the first query's own position included, less the keys it must keep for
   itself); two requests share the leading pages their page tables have in common (the same
   page ids, in the same positions).
2. *A group saves ``(members - 1) x shared keys`` reads* (per layer and kv head): its shared
   keys are read once for all members instead of once each.
3. *Among the groupings allowed, the one that saves the most reads is chosen*, under two
   floors: a group shares at least ``min_shared_keys`` keys (below it the extra merge costs
   more than the reads it saves), and the batch's groups together save at least
   ``min_saved_fraction`` of the plain plan's reads (else the plain plan runs).

What differs between the backends (``CascadeRule`` values; why):

=========================  ===========  ==========  ==========================================
                           FlashInfer   native      why
=========================  ===========  ==========  ==========================================
``own_keys``               1            0           FlashInfer's levels may not be empty for a
                                                    request (its empty-request path has had
                                                    NaN bugs); native's own tile may be.
``min_shared_keys``        1 page       64          native merges per tile: a group sharing
                                                    fewer keys runs slower than private tiles
                                                    (``kMinCascadeKeys``, measured on CPU).
``min_saved_fraction``     0.25         0           FlashInfer's cascade replaces the one plain
                                                    kernel for the *whole batch* by two kernels
                                                    and a merge; native's groups are tiles of
                                                    their own and the rest runs as before.
grouping                   consecutive  by first    FlashInfer's level 0 takes one contiguous
                           requests     page id     query range per group; native gathers a
                                                    group's query rows from anywhere.
=========================  ===========  ==========  ==========================================

C++ keeps its own copy because the native planner runs inside ``na_plan_create`` (no Python
on the plan path); ``NATIVE`` below states its values so that both are read side by side.

>>> plan_cascade([1, 1, 1], [40, 40, 20], [0, 3, 6, 8], [7, 8, 9, 7, 8, 5, 4, 2], 16,
...              CascadeRule(min_saved_fraction=0.0))
CascadeGroups(groups=((0, 2),), shared_pages=(2,), page_size=16, total_tokens=100)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "FLASHINFER",
    "NATIVE",
    "CascadeGroups",
    "CascadeRule",
    "cascade_groups",
    "plan_cascade",
]


@dataclasses.dataclass(frozen=True, slots=True)
class CascadeRule:
    """The thresholds of the cascade rule (see the module's docstring)."""

    #: A group shares at least this many keys (whole pages; 1: any whole page).
    min_shared_keys: int = 1
    #: The groups save at least this fraction of the plain plan's key reads.
    min_saved_fraction: float = 0.0
    #: Keys each request keeps out of the shared level.
    own_keys: int = 1


#: FlashInfer's values (``FlashInferBackend``; its module constants
#: ``CASCADE_MIN_SAVED_FRACTION`` / ``CASCADE_MIN_SHARED_KEYS`` override them per plan).
#: The fraction is a guess not yet measured on a GPU (bench/gpu.sh has no cascade row).
FLASHINFER = CascadeRule(min_shared_keys=1, min_saved_fraction=0.25, own_keys=1)
#: The native backend's values, as ``csrc`` applies them (``kMinCascadeKeys`` = 64).
NATIVE = CascadeRule(min_shared_keys=64, min_saved_fraction=0.0, own_keys=0)


@dataclasses.dataclass(frozen=True, slots=True)
class CascadeGroups:
    """What a cascade plan reads once: request ranges ``groups[g] = (first, stop)`` (stop
    excluded) whose page tables start with the same ``shared_pages[g]`` pages (same page ids,
    whole pages). ``saved_tokens``: key/value token reads per layer and kv head that the plain
    plan makes and the cascade does not; ``total_tokens``: the plain plan's reads.

    >>> c = CascadeGroups(groups=((0, 4),), shared_pages=(3,), page_size=16, total_tokens=256)
    >>> c.shared_tokens, c.saved_tokens, str(c)
    ((48,), 144, 'cascade: 1 group (4 requests) shares 48 tokens; reads 144 of 256 tokens less')
    """

    groups: tuple[tuple[int, int], ...]
    shared_pages: tuple[int, ...]
    page_size: int
    total_tokens: int

    @property
    def shared_tokens(self) -> tuple[int, ...]:
        return tuple(p * self.page_size for p in self.shared_pages)

    @property
    def saved_tokens(self) -> int:
        return sum(
            (stop - first - 1) * tokens
            for (first, stop), tokens in zip(self.groups, self.shared_tokens, strict=True)
        )

    def __str__(self) -> str:
        n = len(self.groups)
        sizes = "+".join(str(stop - first) for first, stop in self.groups)
        shared = "+".join(str(t) for t in self.shared_tokens)
        return (
            f"cascade: {n} group{'s' if n != 1 else ''} ({sizes} requests) shares {shared} "
            f"tokens; reads {self.saved_tokens} of {self.total_tokens} tokens less"
        )


def _common_pages(pages: Sequence[int], a: int, b: int, limit: int) -> int:
    """How many leading pages ``pages[a:]`` and ``pages[b:]`` have in common, up to ``limit``
    (slice compares run in C; a binary search finds the first difference)."""
    if pages[a : a + limit] == pages[b : b + limit]:
        return limit
    lo, hi = 0, limit  # pages[a:a+lo] == pages[b:b+lo]; they differ within the first hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pages[a : a + mid] == pages[b : b + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _split(common: list[int], first: int, last: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Best grouping of the consecutive requests ``first..last`` (each adjacent pair sharing
    ``common[i]`` >= 1 leading pages): one group sharing the smallest common prefix, or the
    best groupings of the two sides of the pair where that prefix is smallest, whichever saves
    more page reads. Returns (pages saved, [(first, stop, shared pages)])."""
    # An explicit stack (post-order) instead of recursion: a batch may hold thousands of
    # requests.
    results: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    stack: list[tuple[int, int, bool]] = [(first, last, False)]
    while stack:
        a, b, ready = stack.pop()
        if a == b:
            results[(a, b)] = (0, [(a, a + 1, 0)])
            continue
        part = common[a:b]
        low = min(part)
        whole = (b - a) * low
        if max(part) == low:  # no split can save more than one group (the usual case)
            results[(a, b)] = (whole, [(a, b + 1, low)])
            continue
        k = a + part.index(low)
        if not ready:
            stack += [(a, b, True), (a, k, False), (k + 1, b, False)]
            continue
        left, right = results.pop((a, k)), results.pop((k + 1, b))
        if left[0] + right[0] > whole:
            results[(a, b)] = (left[0] + right[0], left[1] + right[1])
        else:
            results[(a, b)] = (whole, [(a, b + 1, low)])
    return results[(first, last)]


def cascade_groups(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    kv_indptr: Sequence[int],
    pages: Sequence[int],
    page_size: int,
    rule: CascadeRule = FLASHINFER,
) -> list[tuple[int, int, int]]:
    """Split a batch into runs of consecutive requests ``(first, stop, shared_pages)``: the
    requests of a run start with the same ``shared_pages`` pages (0 for a request in no
    group). ``kv_indptr`` indexes ``pages`` with exactly ceil(kv_len / page_size) pages per
    request. Rules 1-3 of the module's docstring, but for ``min_saved_fraction``.

    >>> cascade_groups([1, 1, 1], [40, 40, 20], [0, 3, 6, 8], [7, 8, 9, 7, 8, 5, 4, 2], 16)
    [(0, 2, 2), (2, 3, 0)]
    """
    n = len(kv_lens)
    # whole pages every query sees, less the keys each request keeps (rule 1)
    room = [
        (kv - max(q, 1) + 1 - rule.own_keys) // page_size
        for q, kv in zip(q_lens, kv_lens, strict=True)
    ]
    floor = -(-rule.min_shared_keys // page_size)  # pages: ceil(keys / page_size), >= 1
    floor = max(floor, 1)
    common = []
    for i in range(n - 1):
        limit = min(room[i], room[i + 1])
        shared = _common_pages(pages, kv_indptr[i], kv_indptr[i + 1], limit) if limit > 0 else 0
        # A pair sharing fewer pages than the floor is in no group together (rule 3): any
        # group holding both would share at most that many.
        common.append(shared if shared >= floor else 0)
    groups: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        j = i
        while j < n - 1 and common[j] > 0:
            j += 1
        groups += _split(common, i, j)[1]
        i = j + 1
    return groups


def plan_cascade(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    kv_indptr: Sequence[int],
    pages: Sequence[int],
    page_size: int,
    rule: CascadeRule = FLASHINFER,
    *,
    groups: list[tuple[int, int, int]] | None = None,
) -> CascadeGroups | None:
    """What a cascade of this batch shares, or None where the plain plan runs (nothing shared,
    or less saved than ``rule.min_saved_fraction``). ``groups``: ``cascade_groups``'s result
    when the caller has it already."""
    if groups is None:
        groups = cascade_groups(q_lens, kv_lens, kv_indptr, pages, page_size, rule)
    shared = [(first, stop, p) for first, stop, p in groups if p > 0]
    info = CascadeGroups(
        groups=tuple((first, stop) for first, stop, _ in shared),
        shared_pages=tuple(p for _, _, p in shared),
        page_size=page_size,
        total_tokens=sum(kv_lens),
    )
    if not shared or info.saved_tokens < rule.min_saved_fraction * info.total_tokens:
        return None
    return info
