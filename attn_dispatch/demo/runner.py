"""A model runner: one model, its own paged cache, page allocator and attention binding."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnForm
from attn_dispatch import BackendSpec
from attn_dispatch import Binding
from attn_dispatch import DispatchEvent
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import record_dispatch
from attn_dispatch._errors import CacheFullError
from attn_dispatch.demo.layers import PagedModel


class PageAllocator:
    """A free list of page ids. ``alloc`` hands out the lowest free ids first."""

    def __init__(self, num_pages: int, label: str) -> None:
        self.num_pages = num_pages
        self.label = label
        self._free = list(range(num_pages - 1, -1, -1))
        self.peak = 0  # the most pages in use at once

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(self.label, n, len(self._free), self.num_pages)
        pages = [self._free.pop() for _ in range(n)]
        self.peak = max(self.peak, self.num_pages - len(self._free))
        return pages

    def free(self, pages: Sequence[int]) -> None:
        # Keep the list sorted high -> low so the lowest id is reused first (deterministic).
        self._free.extend(pages)
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)


@dataclasses.dataclass(slots=True)
class SeqKV:
    """One request's pages in one runner's cache and the number of tokens they hold; its
    first ``shared`` pages are other requests' too (a shared prefix: never freed by it)."""

    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0
    shared: int = 0


class Runner:
    """One model runner: a model, its own paged cache and its own ``attn_binding``.

    Every forward opens ``attn_scope(self, batch)``; the model's layers call
    ``attention(...)``, which runs this runner's backend for ``batch.phase``. ``spec`` is the
    choice this runner was given (default: its binding's); ``dispatched`` holds the
    ``record_dispatch`` events of its own forwards, whatever binding they reached, so the
    report can check them against ``spec``."""

    def __init__(
        self,
        label: str,
        model: PagedModel,
        binding: Binding,
        *,
        num_pages: int,
        spec: BackendSpec | None = None,
    ) -> None:
        self.label = label
        self.model = model
        self.attn_binding = binding
        self.spec = binding.spec if spec is None else spec
        # A list, counted once by the report: hashing each event per forward costs more.
        self.dispatched: list[DispatchEvent] = []
        cfg = binding.config
        self.page_size = cfg.page_size
        self.device = cfg.device
        self.num_pages = num_pages
        self.caches = model.make_caches(num_pages, cfg.page_size, cfg.device)
        self.allocator = PageAllocator(num_pages, label)
        self.forwards = 0
        # Per phase, each forward's seconds and its attention calls' part (None on a GPU,
        # where a call returns before its kernel ends): what a forward costs.
        self.samples: dict[Phase, list[tuple[float, float | None]]] = {p: [] for p in Phase}
        self._attention_s = 0.0

    # How layers reach a kernel; LegacyRunner overrides these three.
    def scope(self, batch: AttnBatch) -> AbstractContextManager[Any]:
        return attn_scope(self, batch)

    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out: torch.Tensor = attention(*args, **kwargs)
        self._attention_s += time.perf_counter() - t0
        return out

    def form(self) -> AttnForm:
        form: AttnForm = attention_form()
        return form

    def reset(self) -> None:
        self.allocator = PageAllocator(self.num_pages, self.label)

    def reserve(self, seq: SeqKV, length: int) -> None:
        """Make ``seq`` own enough pages for ``length`` tokens (its length is the caller's)."""
        need = -(-length // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.allocator.alloc(need))

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Keep ``length`` tokens; pages past them go back to the free list."""
        keep = max(-(-length // self.page_size), seq.shared)
        if keep < len(seq.pages):
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
        seq.length = length

    def release(self, seq: SeqKV) -> None:
        self.truncate(seq, 0)

    def rows(self, pages: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Flat cache rows (page * page_size + slot) of token positions in a page table."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in positions]

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move cached tokens (every layer) from rows ``src`` to rows ``dst``."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.caches:
            for cache in (k_cache, v_cache):
                if cache is not None:
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[d] = flat[s]

    def forward(
        self,
        batch: AttnBatch,
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: Sequence[int],
    ) -> torch.Tensor:
        """One forward of this runner: logits ``[T, vocab]`` (fp32)."""
        dev = self.device
        t0 = time.perf_counter()
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        row = torch.tensor(rows, dtype=torch.long, device=dev)
        self.forwards += 1
        self._attention_s = 0.0
        with record_dispatch() as rec, self.scope(batch):
            # Forms are an MLA matter: an MHA binding's scope has none to ask for.
            form = self.form() if self.model.kind == "mla" else AttnForm.MHA
            logits = self.model.forward(tok, pos, row, self.caches, self.attend, form, batch)
        self.dispatched.extend(rec.events)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        attention = self._attention_s if self.device == "cpu" else None
        self.samples[batch.phase].append((time.perf_counter() - t0, attention))
        return logits.float()

    def median_ms(self, phase: Phase, *, attention: bool = False) -> float | None:
        """The median wall time of this runner's ``phase`` forwards so far in ms (of their
        attention calls: ``attention=True``, CPU only), None if none ran or not measured.
        A median: the first forward's warm-up and bursts of other load do not move it."""
        times = [a if attention else f for f, a in self.samples[phase]]
        if not times or None in times:
            return None
        return statistics.median(t for t in times if t is not None) * 1e3
