"""The cascade planner (attn_dispatch.backends._cascade): pure Python, no kernel library.

FlashInfer plans with it; the native backend applies the same rule in C++. Where the two
groupings agree (requests that share a first page stand next to each other in the batch), the
planner with the native values (``NATIVE``) chooses what the compiled planner chooses: that is
checked against the native library when it is built.
"""

from __future__ import annotations

import itertools

import pytest

from attn_dispatch.backends._cascade import FLASHINFER
from attn_dispatch.backends._cascade import NATIVE
from attn_dispatch.backends._cascade import CascadeGroups
from attn_dispatch.backends._cascade import CascadeRule
from attn_dispatch.backends._cascade import cascade_groups
from attn_dispatch.backends._cascade import plan_cascade


def flat(tables: list[list[int]]) -> tuple[list[int], list[int]]:
    """(kv_indptr, pages) of per-request page tables."""
    indptr = [0, *itertools.accumulate(len(t) for t in tables)]
    return indptr, [p for t in tables for p in t]


def groups(
    q: list[int], kv: list[int], tables: list[list[int]], ps: int, rule: CascadeRule
) -> list[tuple[int, int, int]]:
    indptr, pages = flat(tables)
    return cascade_groups(q, kv, indptr, pages, ps, rule)


ANY_PAGE = CascadeRule(min_shared_keys=1, min_saved_fraction=0.0, own_keys=1)


def test_the_planner_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import attn_dispatch.backends._cascade; "
        "print('torch' in sys.modules or 'flashinfer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_groups_share_whole_pages_before_every_query() -> None:
    # all share two pages; the third page differs per request
    assert groups([1] * 3, [12, 11, 10], [[4, 5, 6], [4, 5, 7], [4, 5, 8]], 4, ANY_PAGE) == [
        (0, 3, 2)
    ]
    # 8 keys, 1 query: the second page holds the query, so one page is shared (own_keys=1) ...
    assert groups([1, 1], [8, 8], [[4, 5], [4, 5]], 4, ANY_PAGE) == [(0, 2, 1)]
    # ... and with own_keys=0 (native) the query's own position may be shared too
    zero_own = CascadeRule(min_shared_keys=1, own_keys=0)
    assert groups([1, 1], [8, 8], [[4, 5], [4, 5]], 4, zero_own) == [(0, 2, 2)]
    # a 4-token verify chain on 9 keys: one whole page before its first query
    assert groups([4, 4], [9, 9], [[4, 5, 6], [4, 5, 6]], 4, ANY_PAGE) == [(0, 2, 1)]
    # the same page ids at other positions are not a shared prefix
    assert groups([1, 1], [12, 12], [[4, 5, 6], [9, 4, 5]], 4, ANY_PAGE) == [(0, 1, 0), (1, 2, 0)]


def test_the_grouping_that_saves_most_reads_wins() -> None:
    # one request shares a page with three that share five: (3 - 1) x 5 > (4 - 1) x 1
    tables = [[1, 2, 3], [1, 5, 6, 7, 8, 10], [1, 5, 6, 7, 8, 11], [1, 5, 6, 7, 8, 12]]
    assert groups([1] * 4, [9, 21, 21, 21], tables, 4, ANY_PAGE) == [(0, 1, 0), (1, 4, 5)]
    # two runs (a break between requests 1 and 2), one group each
    tables = [[1, 2, 9], [1, 2, 8], [3, 4, 7], [3, 4, 6]]
    assert groups([1] * 4, [12] * 4, tables, 4, ANY_PAGE) == [(0, 2, 2), (2, 4, 2)]


def test_the_shared_key_floor_keeps_small_shares_private() -> None:
    tables = [[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 3, 7]]
    q, kv = [1, 1, 1], [60, 60, 60]  # 3 pages of 16 = 48 shared keys
    assert groups(q, kv, tables, 16, ANY_PAGE) == [(0, 3, 3)]
    assert groups(q, kv, tables, 16, NATIVE) == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]
    tables = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8], [1, 2, 3, 5, 7]]  # 64 and 48 keys
    kv = [70, 70, 70]
    # the pair (1, 2) shares 48 keys < 64: only (0, 1) group, on their 4 pages
    assert groups(q, kv, tables, 16, NATIVE) == [(0, 2, 4), (2, 3, 0)]
    assert NATIVE.min_shared_keys == 64  # csrc/kernels.h kMinCascadeKeys


def test_the_saved_fraction_decides_the_whole_plan() -> None:
    tables = [[1, 2, 3, 4], [1, 6, 7, 8]]  # one shared page of four: saves 4 of 32 reads
    indptr, pages = flat(tables)
    assert plan_cascade([1, 1], [16, 16], indptr, pages, 4, FLASHINFER) is None  # < 25%
    rule = CascadeRule(min_saved_fraction=0.1)
    info = plan_cascade([1, 1], [16, 16], indptr, pages, 4, rule)
    assert info == CascadeGroups(groups=((0, 2),), shared_pages=(1,), page_size=4, total_tokens=32)
    assert info.saved_tokens == 4 and "reads 4 of 32 tokens less" in str(info)
    # nothing shared: no plan whatever the fraction
    indptr, pages = flat([[1, 2], [3, 4]])
    assert plan_cascade([1, 1], [8, 8], indptr, pages, 4, CascadeRule()) is None


def test_flashinfer_keeps_its_thresholds() -> None:
    # The values FlashInfer planned with before the planner was shared: any whole page, a
    # quarter of the reads saved, one key of its own per request.
    assert FLASHINFER == CascadeRule(min_shared_keys=1, min_saved_fraction=0.25, own_keys=1)


def test_thousands_of_requests_plan_without_recursion() -> None:
    n = 5000
    tables = [[0, 1, 2, 10 + i] for i in range(n)]
    out = groups([1] * n, [16] * n, tables, 4, ANY_PAGE)
    assert out == [(0, n, 3)]


# -- against the native library (where the two groupings agree) -------------------------------


def _native() -> object:
    torch = pytest.importorskip("torch")
    from attn_dispatch.backends.native._lib import load

    lib = load()
    if isinstance(lib, str):
        pytest.skip(f"native library: {lib}")
    return torch


@pytest.mark.parametrize(
    ("tables", "kv_lens"),
    [
        # one group over 5 pages (80 keys >= 64), a private request after it
        ([[0, 1, 2, 3, 4, 20], [0, 1, 2, 3, 4, 21], [30, 31]], [90, 90, 20]),
        # shares of 48 keys only: below the floor, all private
        ([[0, 1, 2, 20], [0, 1, 2, 21]], [60, 60]),
        # two groups of consecutive requests, shares of 4 and 6 pages
        ([[0, 1, 2, 3, 20], [0, 1, 2, 3, 21], [5, 6, 7, 8, 9, 10, 22], [5, 6, 7, 8, 9, 10, 23]],
         [70, 70, 100, 100]),
        # a request whose pages all lie before its query: it may share all it sees (own 0)
        ([[0, 1, 2, 3], [0, 1, 2, 3, 24]], [64, 70]),
    ],
)  # fmt: skip
def test_native_rule_agrees_with_the_compiled_planner(
    tables: list[list[int]], kv_lens: list[int]
) -> None:
    _native()
    from attn_dispatch import AttnBatch
    from attn_dispatch import AttnConfig
    from attn_dispatch import Phase
    from attn_dispatch.backends.native.backend import NativeBackend

    ps = 16
    q = [1] * len(kv_lens)
    batch = AttnBatch.build(Phase.DECODE, q_lens=q, kv_lens=kv_lens, page_tables=tables,
                            page_size=ps, num_pages=32)  # fmt: skip
    plan = NativeBackend(AttnConfig("mha", 4, 2, 64, dtype="float32", page_size=ps)).plan(batch)
    indptr, pages = flat(tables)
    info = plan_cascade(q, kv_lens, indptr, pages, ps, NATIVE)
    want = (0, 0, 0) if info is None else (
        len(info.groups),
        sum(stop - first for first, stop in info.groups),
        sum(info.shared_tokens),
    )  # fmt: skip
    got = (plan.cascade_groups, plan.cascade_requests, plan.cascade_keys)
    assert got == want
