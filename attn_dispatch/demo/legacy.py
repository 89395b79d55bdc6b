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
from attn_dispatch._table import format_table
from attn_dispatch.demo.engine import speculative
from attn_dispatch.demo.engine import target_greedy
from attn_dispatch.demo.report import Say
from attn_dispatch.demo.report import prefix_equal
from attn_dispatch.demo.runner import Runner
from attn_dispatch.demo.values import DemoOptions


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

    It takes ``Runner``'s arguments and the globals it writes to, and registers its backend at
    construction (start-up order is construction order)."""

    def __init__(self, *args: Any, globals_: LegacyGlobals, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals = globals_
        globals_.start_runner(self.label, self.attn_binding)

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
        phase = batch.phase.name.lower()
        backend = g.backends[name]
        try:
            out: torch.Tensor = backend.handler(batch.phase)(
                q, k_cache, v_cache, backend.plan(batch), sm_scale
            )
        except Exception:
            g.log[(label, phase, name, "failed")] += 1
            raise
        g.log[(label, phase, name, "ran")] += 1
        return out

    def form(self) -> AttnForm:
        return AttnForm.MLA  # no scope to ask: the layers assume their usual form


def run_legacy(
    say: Say,
    legacy: LegacyGlobals,
    target: Runner,
    draft: Runner,
    prompts: list[list[int]],
    opts: DemoOptions,
) -> int:
    say("\nlegacy pattern: one process-wide setting, written at start-up, read at forward time")
    for line in legacy.history:
        say(f"  {line}")
    failure = None
    outputs: list[list[int]] = []
    try:
        outputs, _ = speculative(target, draft, prompts, opts)
    except Exception as exc:
        failure = exc
    say("\nwhat the layers actually ran (runner x phase x backend -> calls)")
    rows: list[tuple[str, ...]] = [(*k, str(v)) for k, v in sorted(legacy.log.items())]
    say(format_table(("runner", "phase", "backend", "result", "calls"), rows))
    tname = target.attn_binding.backend_name(Phase.PREFILL)
    dname = draft.attn_binding.backend_name(Phase.DECODE)
    wrong = sum(v for k, v in legacy.log.items() if k[0] == "target" and k[2] != tname)
    dc = draft.attn_binding.config
    built_for = (
        f"built for the draft's {dc.kind.upper()} config: {dc.num_q_heads} q / "
        f"{dc.num_kv_heads} kv heads, head_dim {dc.head_dim}, page_size {dc.page_size}"
    )
    if failure is not None:
        say(
            f"\nthe target's MLA layers read the global at forward time and got backend "
            f"{legacy.attention_backend!r} as the draft set it up ({built_for}); the target had "
            f"chosen {tname!r} for MLA (head_dim {target.attn_binding.config.head_dim}). "
            "Its first forward failed in the draft's backend:\n"
            f"  {type(failure).__name__}: {failure}"
        )
    elif wrong:
        say(
            f"\nthe target's MLA layers ran the draft's backend {dname!r} in {wrong} calls "
            f"(it chose {tname!r})"
        )
    # The reference (the target alone) is computed only when the legacy run got anywhere.
    same = False
    if failure is None and outputs:
        scoped = Runner("target", target.model, target.attn_binding, num_pages=target.num_pages)
        same = prefix_equal(outputs, target_greedy(scoped, prompts, opts.max_new_tokens))
    say(f"identical to target greedy: {'yes' if same else 'no'}")
    say(
        "This is SGLang issue 28528 (draft start-up overwrote the global backend; the target's "
        "DeepSeek MLA layers then hit a head-dim assertion in the wrong kernel). Without "
        "--legacy-global each runner dispatches through its own binding in attn_scope."
    )
    return 0 if same else 1
