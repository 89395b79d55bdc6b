"""The page allocator of the paged cache: page numbers only, no tensors.

One ``PageGroup`` per attention group (``"full"``, ``"sliding"``, ``"chunked"``): a page table
per request (shared by the group's layers, whose pools use the same page numbers), the pages
dropped before each table's first page (sliding and chunked groups), a free list, and the
count of pages handed out at least once (``fresh``). The cache (``_cache.PagedCache``) asks it
where new tokens go, which pages a beam reorder copies where, which pages a crop or a window
frees and how to renumber the live pages when the pools shrink; it moves the bytes itself.

A sliding group keeps the pages that hold the ``sliding_window - 1`` tokens before the next
query; a chunked group (Llama 4, ``attention_chunk_size`` C) the pages from the next query's
chunk, freed in whole multiples of ``lcm(page_size, C)`` tokens, so that a request's positions
move by whole chunks and the contract's chunk boundaries (counted from the first key left)
stay put.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(slots=True, eq=False)
class Allocation:
    """A group's page tables as one forward leaves them: made by ``PageGroup.plan``, kept by
    ``PageGroup.adopt`` when the forward commits, dropped when it fails."""

    tables: list[list[int]]
    skips: list[int]
    free: list[int]
    fresh: int


@dataclasses.dataclass(slots=True, eq=False)
class PageGroup:
    """Page tables of one attention group."""

    name: str
    window: int | None  # transformers' sliding_window W (keys seen, the query's included)
    page_size: int
    chunk: int | None = None  # attention_chunk_size C of a chunked group
    # Per request, set by each forward's commit: its page table and the pages dropped before
    # tables[b][0] (sliding, chunked).
    tables: list[list[int]] = dataclasses.field(default_factory=list)
    skips: list[int] = dataclasses.field(default_factory=list)
    free: list[int] = dataclasses.field(default_factory=list)
    fresh: int = 0  # pages 0..fresh-1 have been handed out at least once
    capacity: int = 0  # pages in each layer's pools

    @property
    def drops(self) -> bool:
        """Whether pages behind the requests' current positions are freed (window, chunks)."""
        return self.window is not None or self.chunk is not None

    def needed_from(self, length: int) -> int:
        """The first token (of a request holding ``length``) that a next query may see."""
        if self.window is not None:
            return max(0, length - (self.window - 1))
        if self.chunk is not None:
            return length // self.chunk * self.chunk
        return 0

    def droppable(self, length: int) -> int:
        """Whole pages before ``needed_from(length)`` that may be freed: any for a window, for
        chunks only whole multiples of ``lcm(page_size, chunk)`` tokens (positions then move by
        whole chunks)."""
        first = self.needed_from(length)
        if self.chunk is not None:
            unit = math.lcm(self.page_size, self.chunk)
            return first // unit * unit // self.page_size
        return first // self.page_size

    def clear(self, batch: int) -> None:
        """``batch`` empty requests; every page handed out so far is free again."""
        self.tables = [[] for _ in range(batch)]
        self.skips = [0] * batch
        self.free = list(range(self.fresh))[::-1]

    def initial_pages(self, max_length: int | None, batch: int) -> int:
        """Pages to allocate up front for ``batch`` requests of up to ``max_length`` tokens (0
        when the length is not known): a window or chunk bounds what a request keeps."""
        if max_length is None:
            return 0
        ps = self.page_size
        per_row = -(-max_length // ps)
        if self.window is not None:
            per_row = min(per_row, -(-(self.window + ps) // ps) + 1)
        if self.chunk is not None:  # live: under lcm(ps, C) dropped-short plus the chunk
            unit = math.lcm(ps, self.chunk)
            per_row = min(per_row, -(-(unit + self.chunk) // ps) + 1)
        return batch * per_row + batch

    def trim(
        self, tables: list[list[int]], skips: list[int], free: list[int], lens: list[int]
    ) -> None:
        """Free (in the given lists) a sliding group's pages wholly before its window (the next
        query, at each row's length ``lens[b]``, sees ``window - 1`` earlier keys), a chunked
        group's before the next query's chunk (in whole ``lcm(page_size, chunk)`` tokens)."""
        if not self.drops:
            return
        for b, table in enumerate(tables):
            first = self.droppable(lens[b])
            drop = min(first - skips[b], len(table))
            if drop > 0:
                free.extend(table[:drop])
                del table[:drop]
                skips[b] += drop

    def plan(self, lens: list[int], new_lens: list[int], *, trim: bool) -> Allocation:
        """Pages for one forward that takes each request from ``lens[b]`` to ``new_lens[b]``
        tokens (first freeing what the window or chunk left behind, unless the past is
        recorded); the group itself is unchanged until ``adopt``."""
        tables = [list(t) for t in self.tables]
        skips, free, fresh = list(self.skips), list(self.free), self.fresh
        if trim:
            self.trim(tables, skips, free, lens)
        for b, length in enumerate(new_lens):
            if length != lens[b]:
                pages = -(-length // self.page_size) - skips[b]
                fresh = self.extend(tables[b], pages, free, fresh)
        return Allocation(tables, skips, free, fresh)

    def adopt(self, allocation: Allocation) -> None:
        """Make a forward's ``plan`` current (the forward committed)."""
        self.tables, self.skips = allocation.tables, allocation.skips
        self.free, self.fresh = allocation.free, allocation.fresh

    def extend(self, table: list[int], pages: int, free: list[int], fresh: int) -> int:
        """Grow ``table`` to ``pages`` pages, from ``free`` first; returns the new ``fresh``."""
        while len(table) < pages:
            if free:
                table.append(free.pop())
            else:
                table.append(fresh)
                fresh += 1
        return fresh

    def truncate(self, lens: list[int]) -> None:
        """Free each request's pages past its (shorter) length ``lens[b]``: a crop."""
        for b, length in enumerate(lens):
            keep = -(-length // self.page_size) - self.skips[b]
            self.free.extend(self.tables[b][keep:])
            del self.tables[b][keep:]

    def copy_rows(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Make request r a copy of request ``rows[r]`` (a beam reorder, a batch expansion or
        selection): every page of the chosen tables gets a new page (two new rows never share
        one, so later writes cannot reach each other); the old tables' pages are freed.
        Returns the page copies to do, ``(sources, destinations)``: a destination is never a
        page that is also a source, so the copies may run in any order."""
        sources: list[int] = []
        destinations: list[int] = []
        tables: list[list[int]] = []
        free = list(self.free)  # pages no current table holds: never a source
        fresh = self.fresh
        for r in rows:
            table = []
            for page in self.tables[r]:
                if free:
                    new = free.pop()
                else:
                    new = fresh
                    fresh += 1
                table.append(new)
                sources.append(page)
                destinations.append(new)
            tables.append(table)
        for table in self.tables:
            free.extend(table)
        self.skips = [self.skips[r] for r in rows]
        self.tables, self.free, self.fresh = tables, free, fresh
        return sources, destinations

    def compaction(self, batch: int) -> tuple[list[int], int] | None:
        """When the pools are mostly free (a long prompt's pages, written by the prefill, then
        left behind by the window or chunk): the live pages, in the order they move to the
        front, and the new capacity; None when the pools stay as they are."""
        if not self.drops:
            return None
        live = [page for table in self.tables for page in table]
        target = max(2 * len(live), 2 * batch, 1)
        if self.capacity <= 2 * target:
            return None
        return live, target

    def compacted(self, live: list[int], target: int) -> None:
        """Renumber after the cache moved page ``live[i]`` to page ``i`` of pools of
        ``target`` pages."""
        where = {page: i for i, page in enumerate(live)}
        self.tables = [[where[page] for page in table] for table in self.tables]
        self.free, self.fresh, self.capacity = [], len(live), target


# The name used before the allocator had its own module.
_Group = PageGroup
