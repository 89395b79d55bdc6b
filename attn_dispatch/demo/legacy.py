"""The pattern attn_dispatch replaces, kept only to show what it does (``--legacy-global``).

One process-wide setting: each runner writes its backend name (and registers the backend
object it built) at start-up, and every layer reads the name at forward time. Whoever started
last wins for everybody: SGLang issue 28528, where the draft's start-up overwrote the global
attention backend and the target's DeepSeek MLA layers then hit the wrong kernel.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnForm
from attn_dispatch import Binding
from attn_dispatch import Phase
from attn_dispatch.demo.models import DraftModel
from attn_dispatch.demo.models import TargetModel
from attn_dispatch.demo.runner import Runner


@dataclasses.dataclass(slots=True)
class LegacyGlobals:
    """The ONE process-wide setting, and a log of what ran under it."""

    attention_backend: str | None = None
    backends: dict[str, Any] = dataclasses.field(default_factory=dict)
    forward: tuple[str, AttnBatch] | None = None  # (runner label, batch) of the running forward
    log: collections.Counter[tuple[str, str, str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    history: list[str] = dataclasses.field(default_factory=list)

    def start_runner(self, label: str, binding: Binding) -> None:
        name = binding.backend_name(Phase.DECODE)
        self.history.append(
            f"{label} start-up: global attention_backend = {name!r}"
            + (f" (overwrites {self.attention_backend!r})" if self.attention_backend else "")
        )
        self.attention_backend = name
        self.backends[name] = binding.backend(Phase.DECODE)


class LegacyRunner(Runner):
    """A runner whose layers find their kernel through ``LegacyGlobals``, not ``attn_scope``.

    It registers its backend at construction (start-up order is construction order)."""

    def __init__(
        self,
        label: str,
        model: TargetModel | DraftModel,
        binding: Binding,
        *,
        num_pages: int,
        globals_: LegacyGlobals,
    ) -> None:
        super().__init__(label, model, binding, num_pages=num_pages)
        self.globals = globals_
        globals_.start_runner(label, binding)

    @contextlib.contextmanager
    def scope(self, batch: AttnBatch) -> Iterator[None]:
        self.globals.forward = (self.label, batch)
        try:
            yield
        finally:
            self.globals.forward = None

    def attend(
        self, q: Any, k_cache: Any, v_cache: Any = None, *, sm_scale: float, **_: Any
    ) -> torch.Tensor:
        g = self.globals
        assert g.forward is not None and g.attention_backend is not None
        label, batch = g.forward
        name = g.attention_backend  # read at forward time: the last writer's choice
        key = (label, batch.phase.name.lower(), name)
        backend = g.backends[name]
        try:
            out: torch.Tensor = backend.handler(batch.phase)(
                q, k_cache, v_cache, backend.plan(batch), sm_scale
            )
        except Exception:
            g.log[(*key, "failed")] += 1
            raise
        g.log[(*key, "ran")] += 1
        return out

    def form(self) -> AttnForm:
        return AttnForm.MLA  # no scope to ask: the layers assume their usual form
