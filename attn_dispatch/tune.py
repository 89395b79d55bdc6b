"""Measure which backend is fastest per layer group and phase on this machine (``tune``).

``tune(configs)`` times every registered backend that can serve each layer group x phase
(prefill, decode, verify) at sizes derived from the config (or given), on this machine, and
recommends one spec string per group: the fastest backend per phase. It only recommends;
binding stays the caller's choice. ``python -m attn_dispatch tune`` prints the table.

A backend that cannot serve a phase is listed with the reason ``bind`` gives; nothing is
emulated or substituted. The other phases of a timed binding are served by the reference
(``torch``), so only the timed phase's backend varies.

>>> from attn_dispatch import AttnConfig
>>> cfg = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16,
...                  dtype="float32", page_size=16)
>>> report = tune({"": cfg}, sizes=TuneSizes(prefill_len=32, decode_batch=2,
...               context=64, repeats=2), backends=["torch"])
>>> report.recommended[""]
'torch'
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase

__all__ = [
    "BucketDecision",
    "PhaseTiming",
    "TuneReport",
    "TuneSizes",
    "check_device",
    "check_memory",
    "decide",
    "machine_name",
    "memory_needed",
    "tune",
]

# The backend that serves the phases not being timed: it serves every config it is given.
_BASELINE = "torch"
# Seconds of timed calls per cell, at most (and at least one call).
_CELL_BUDGET_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class TuneSizes:
    """The batch shapes ``tune`` times (per phase, per layer group).

    Prefill: ``prefill_batch`` prompts of ``prefill_len`` tokens over no prefix. Decode:
    ``decode_batch`` requests with ``context`` tokens each. Verify: the same requests with
    ``draft_tokens`` new tokens each. ``repeats`` timed calls per cell (after one warm-up);
    ``layers`` calls per forward (the plan is paid once per forward).
    """

    prefill_batch: int = 2
    prefill_len: int = 512
    decode_batch: int = 8
    context: int = 1024
    draft_tokens: int = 4
    repeats: int = 5
    layers: int = 1
    #: More prompt lengths to time prefill at (shape buckets by ``q_len``), besides
    #: ``prefill_len``; ``()``: that one size only.
    prefill_lens: tuple[int, ...] = ()
    #: More contexts to time decode and verify at (shape buckets by ``context``), besides
    #: ``context``.
    contexts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("prefill_lens", "contexts"):
                if not isinstance(v, (tuple, list)) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v
                ):
                    raise InvalidSpecError(f.name, v, "must be a sequence of ints >= 1")
                object.__setattr__(self, f.name, tuple(sorted(set(v))))
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidSpecError(f.name, v, "must be an int >= 1")

    def sizes_of(self, phase: Phase) -> tuple[int, ...]:
        """The prompt lengths (prefill) or contexts (decode, verify) ``phase`` is timed at."""
        if phase is Phase.PREFILL:
            return tuple(sorted({self.prefill_len, *self.prefill_lens}))
        return tuple(sorted({self.context, *self.contexts}))

    def at(self, phase: Phase, size: int) -> TuneSizes:
        """These sizes with ``phase``'s timed length set to ``size``."""
        if phase is Phase.PREFILL:
            return dataclasses.replace(self, prefill_len=size)
        return dataclasses.replace(self, context=size)

    @property
    def bucketed(self) -> bool:
        """Whether some phase is timed at more than one size."""
        return bool(set(self.prefill_lens) - {self.prefill_len}) or bool(
            set(self.contexts) - {self.context}
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseTiming:
    """One backend on one group x phase: median seconds per call and per plan, or why not."""

    group: str
    phase: str
    backend: str
    call_s: float | None
    plan_s: float | None
    refused: str | None = None
    #: The batch measure this cell was timed at: its longest query (prefill, ``q_len``) or
    #: longest context, new tokens included (decode and verify, ``context``); 0: unknown.
    size: int = 0
    #: The noise of this cell: the range (max - min) of its timed forwards, in seconds;
    #: None when fewer than two rounds were timed (no spread measured).
    noise_s: float | None = None

    def forward_s(self, layers: int) -> float | None:
        """One forward: one plan and ``layers`` calls."""
        if self.call_s is None or self.plan_s is None:
            return None
        return self.plan_s + layers * self.call_s


@dataclasses.dataclass(frozen=True, slots=True)
class TuneReport:
    """What ``tune`` measured, and the recommended spec per group."""

    machine: str
    threads: int
    sizes: TuneSizes
    timings: tuple[PhaseTiming, ...]
    recommended: Mapping[str, str]
    #: Registered backends that cannot run on this machine at all, with the reason.
    unavailable: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def decisions(self) -> dict[tuple[str, str], BucketDecision]:
        """(group, phase) -> the winner and the bucket decision made from these timings."""
        out: dict[tuple[str, str], BucketDecision] = {}
        for t in self.timings:
            key = (t.group, t.phase)
            if key not in out:
                cells = [c for c in self.timings if (c.group, c.phase) == key]
                got = decide(t.phase, cells, self.sizes)
                if got is not None:
                    out[key] = got
        return out

    def table(self) -> str:
        """A plain-text table: one row per group x phase x backend, fastest first."""
        from attn_dispatch._table import format_table

        rows = []
        for t in self.timings:
            f = t.forward_s(self.sizes.layers)
            rows.append(
                (
                    t.group or "-",
                    t.phase,
                    f"{MEASURE_OF[t.phase]} {t.size}" if t.size else "-",
                    t.backend,
                    "-" if t.call_s is None else f"{t.call_s * 1e3:.3f}",
                    "-" if t.plan_s is None else f"{t.plan_s * 1e3:.3f}",
                    "-" if f is None else f"{f * 1e3:.3f}",
                    "-" if t.noise_s is None else f"{t.noise_s * 1e3:.3f}",
                    "" if t.refused is None else f"refused: {t.refused}",
                )
            )
        head = (
            "group", "phase", "at", "backend", "call ms", "plan ms", "forward ms", "noise ms",
            "note",
        )  # fmt: skip
        lines = [f"machine: {self.machine}; threads: {self.threads}; sizes: {self.sizes}"]
        lines.append(format_table(head, rows))
        for name, why in self.unavailable.items():
            lines.append(f"not timed: {name}: {why}")
        for group, spec in self.recommended.items():
            lines.append(f"recommended{'' if not group else f' [{group}]'}: {spec}")
        for (group, phase), d in self.decisions.items():
            if d.sizes[1:]:
                lines.append(f"buckets{'' if not group else f' [{group}]'} {phase}: {d.why}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "machine": self.machine,
                "threads": self.threads,
                "sizes": dataclasses.asdict(self.sizes),
                "timings": [dataclasses.asdict(t) for t in self.timings],
                "recommended": dict(self.recommended),
                "unavailable": dict(self.unavailable),
                "buckets": {f"{g}/{p}" if g else p: d.why for (g, p), d in self.decisions.items()},
            },
            indent=2,
        )


def machine_name(device: str = "cpu") -> str:
    """The CPU (and the ISA path native runs) or the CUDA device, for every figure."""
    import platform

    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from attn_dispatch.backends.native import _lib

    lib = _lib.load()
    isa = f"native unavailable: {lib}" if isinstance(lib, str) else f"native ISA {lib.isa}"
    return f"{cpu}; {isa}"


def check_device(device: str) -> None:
    """Refuse (``InvalidSpecError``) a device ``tune`` cannot time kernels on here: it
    measures this machine, so the device must exist on it (``cpu``, or a CUDA device that
    ``torch.cuda`` sees)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidSpecError("device", device, f"is not a device torch knows ({exc})") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise InvalidSpecError(
            "device", device, "tune times kernels on 'cpu' or a CUDA device ('cuda', 'cuda:1')"
        )
    if not torch.cuda.is_available():
        raise InvalidSpecError(
            "device",
            device,
            "tune times kernels on this machine, which has no CUDA device "
            "(torch.cuda.is_available() is False); run it on the machine the config is meant "
            "for (explain --static checks a config for another machine)",
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise InvalidSpecError(
            "device", device, f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}"
        )


def _memory_budget(device: str) -> int:
    """Half the memory of the device that holds the tensors (the CPU's RAM or the GPU's)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory) // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, OSError, ValueError):
        return 8 << 30


def memory_needed(config: Any, sizes: TuneSizes) -> int:
    """Bytes the largest phase's tensors take (q, K/V cache, output; a float32 draw and its
    copy in the config's dtypes, and one gathered K/V copy some backends make); at the
    largest size each phase is timed at."""
    sizes = dataclasses.replace(
        sizes,
        prefill_len=max(sizes.sizes_of(Phase.PREFILL)),
        context=max(sizes.sizes_of(Phase.DECODE)),
    )
    ps = config.page_size
    dv = config.v_head_dim if config.v_head_dim is not None else config.head_dim
    kv_width = (
        config.head_dim if config.kind == "mla" else config.num_kv_heads * (config.head_dim + dv)
    )
    worst = 0
    # (requests, query tokens per request, cache tokens per request) of each phase.
    for requests, q_len, kv_len in (
        (sizes.prefill_batch, sizes.prefill_len, sizes.prefill_len),
        (sizes.decode_batch, 1, sizes.context),
        (sizes.decode_batch, sizes.draft_tokens, sizes.context + sizes.draft_tokens),
    ):
        slots = requests * -(-kv_len // ps) * ps
        q_elems = requests * q_len * config.num_q_heads * (config.head_dim + dv)
        worst = max(worst, (slots * kv_width * 3 + q_elems) * 8)
    return worst


def check_memory(config: Any, sizes: TuneSizes, *, group: str = "") -> None:
    """Refuse (``InvalidSpecError``) sizes whose tensors would take more than half of the
    device's memory: a mistyped size fails here with the numbers, not in the allocator."""
    need = memory_needed(config, sizes)
    budget = _memory_budget(config.device)
    if need > budget:
        where = f"group {group!r}: " if group else ""
        raise InvalidSpecError(
            "sizes",
            sizes,
            f"{where}these sizes need about {need / (1 << 30):.1f} GiB of tensors on "
            f"{config.device}, more than half of its memory ({budget / (1 << 30):.1f} GiB); "
            "choose smaller --context, --decode-batch, --prefill-len or --prefill-batch",
        )


def _batch_for(config: Any, phase: Phase, sizes: TuneSizes, gen: Any) -> tuple[Any, ...]:
    import torch

    from attn_dispatch._batch import AttnBatch
    from attn_dispatch._batch import tree_mask

    ps = config.page_size
    if phase is Phase.PREFILL:
        q_lens = [sizes.prefill_len] * sizes.prefill_batch
        kv_lens = list(q_lens)
    elif phase is Phase.DECODE:
        q_lens = [1] * sizes.decode_batch
        kv_lens = [sizes.context] * sizes.decode_batch
    else:
        q_lens = [sizes.draft_tokens] * sizes.decode_batch
        kv_lens = [sizes.context + sizes.draft_tokens] * sizes.decode_batch
    need = [math.ceil(k / ps) for k in kv_lens]
    perm = torch.randperm(sum(need), generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    masks = None
    if phase is Phase.VERIFY and config.tree_verify:
        parents = [-1, *range(sizes.draft_tokens - 1)]  # a chain, as a tree
        masks = [tree_mask(parents, k - sizes.draft_tokens) for k in kv_lens]
    dtype = getattr(torch, config.dtype)
    kv_dtype = getattr(torch, config.kv_dtype)
    device = config.device
    batch = AttnBatch.build(
        phase,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        page_size=ps,
        num_pages=len(perm),
        masks=masks,
        device=device,
    )
    q = torch.randn(sum(q_lens), config.num_q_heads, config.head_dim, generator=gen)
    if config.kind == "mla":
        k = torch.randn(len(perm), ps, config.head_dim, generator=gen)
        v = None
    else:
        k = torch.randn(len(perm), ps, config.num_kv_heads, config.head_dim, generator=gen)
        v = torch.randn(len(perm), ps, config.num_kv_heads, config.v_head_dim, generator=gen)
    q = q.to(device=device, dtype=dtype)
    k = k.to(device=device, dtype=kv_dtype)
    v = None if v is None else v.to(device=device, dtype=kv_dtype)
    extras: dict[str, Any] = {}
    if config.sinks:
        extras["sinks"] = torch.zeros(config.num_q_heads, device=device)
    if config.kv_fp8:
        extras["k_scale"] = 1.0
        if config.kind != "mla":
            extras["v_scale"] = 1.0
    return batch, q, k, v, extras


def _spec_for(phase: Phase, backend: str) -> Any:
    from attn_dispatch._spec import BackendSpec

    names = {p: (backend if p is phase else _BASELINE) for p in Phase}
    return BackendSpec(
        prefill=names[Phase.PREFILL], decode=names[Phase.DECODE], verify=names[Phase.VERIFY]
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _time_one(
    group: str,
    config: Any,
    phase: Phase,
    backend: str,
    sizes: TuneSizes,
    registry: Any,
    min_rounds: int = 1,
) -> PhaseTiming:
    import torch

    from attn_dispatch._binding import bind
    from attn_dispatch._scope import attention
    from attn_dispatch._scope import attn_scope

    try:
        binding = bind(
            _spec_for(phase, backend), config, label=f"tune:{backend}", registry=registry
        )
    except AttnDispatchError as e:
        # bind lists one "- <phase> -> '<backend>': <reason>" line per reason: keep this
        # phase's reasons (the headline and the closing advice say nothing about it).
        mark = f"{phase.name.lower()} -> {backend!r}: "
        why = "; ".join(
            line.strip().removeprefix("- ").removeprefix(mark)
            for line in str(e).splitlines()
            if line.strip().removeprefix("- ").startswith(mark)
        )
        why = why or str(e).splitlines()[0]
        return PhaseTiming(group, phase.name.lower(), backend, None, None, refused=why)
    gen = torch.Generator().manual_seed(0)
    batch, q, k, v, extras = _batch_for(config, phase, sizes, gen)
    size = batch.max_q_len if phase is Phase.PREFILL else batch.max_kv_len
    sm_scale = config.sm_scale
    kw: dict[str, Any] = dict(extras)
    if sm_scale is None:
        kw["sm_scale"] = 1.0 / math.sqrt(config.head_dim)
    calls: list[float] = []
    plans: list[float] = []
    rounds = sizes.repeats + 1
    i = 0
    while i < rounds:
        _sync(config.device)
        t0 = time.perf_counter()
        with attn_scope(binding, batch):
            _sync(config.device)
            t1 = time.perf_counter()
            attention(q, k, v, **kw)
            _sync(config.device)
            t2 = time.perf_counter()
        if i:  # the first round warms caches and lazy initialisation
            plans.append(t1 - t0)
            calls.append(t2 - t1)
        else:
            # A slow cell (the reference at large sizes) gets fewer rounds: about a second.
            fits = int(_CELL_BUDGET_S / max(t2 - t0, 1e-9))
            rounds = 1 + max(min_rounds, min(sizes.repeats, fits))
        i += 1
    forwards = [p + sizes.layers * c for p, c in zip(plans, calls, strict=True)]
    return PhaseTiming(
        group,
        phase.name.lower(),
        backend,
        statistics.median(calls),
        statistics.median(plans),
        size=size,
        noise_s=max(forwards) - min(forwards) if len(forwards) > 1 else None,
    )


#: The batch measure each phase's buckets read (``Buckets.measure``).
MEASURE_OF = {"prefill": "q_len", "decode": "context", "verify": "context"}


@dataclasses.dataclass(frozen=True, slots=True)
class BucketDecision:
    """What ``tune`` chose for one group x phase from its timings at every size.

    ``winner``: the fastest backend at the main size (``prefill_len`` or ``context``).
    ``limits`` and ``rest``: the shape buckets (``((bound, backend), ...)``, then the
    catch-all) when the winner changes with the size by more than the noise, else ``()`` and
    ``rest`` the one backend chosen for every size (see ``decide``). ``sizes``: the sizes
    timed (the batch measure); ``why``: one line saying what was decided and on what figures.
    """

    phase: str
    measure: str
    winner: str
    limits: tuple[tuple[int, str], ...]
    rest: str
    sizes: tuple[int, ...]
    why: str

    def spec_text(self) -> str:
        if not self.limits:
            return self.rest
        head = "|".join(f"{self.measure}<={b}:{n}" for b, n in self.limits)
        return f"{head}|{self.rest}"


def _clearly_faster(a: PhaseTiming, b: PhaseTiming, layers: int) -> bool:
    """Whether ``a`` beats ``b`` by more than the noise: the gap between their median
    forwards exceeds the larger of their ranges (and both ranges were measured)."""
    ta, tb = a.forward_s(layers), b.forward_s(layers)
    if ta is None or tb is None or a.noise_s is None or b.noise_s is None:
        return False
    return tb - ta > max(a.noise_s, b.noise_s)


def decide(phase: str, cells: Sequence[PhaseTiming], sizes: TuneSizes) -> BucketDecision | None:
    """The winner and the shape buckets of one group x phase from its cells (None when no
    backend served it at the main size).

    The rule (docs/guides/tune.md, "Shape buckets"): at each size timed, the fastest median
    forward wins. Buckets are emitted only if the winner changes with the size and, at every
    change between two neighbouring sizes, each side's winner beats the other side's by more
    than the noise at its own size (the gap between medians exceeds the larger of the two
    cells' ranges). A bucket's upper bound is the geometric mean of the two sizes around the
    change (the crossover lies between them). Otherwise the phase gets one backend for every
    size: the one with the least sum of median forwards over the sizes timed (the winner at
    the main size breaks a tie); with one size, that size's winner.
    """
    layers = sizes.layers
    by_size: dict[int, dict[str, PhaseTiming]] = {}
    for c in cells:
        if c.phase == phase and c.call_s is not None:
            by_size.setdefault(c.size, {})[c.backend] = c
    if not by_size:
        return None
    ordered = sorted(by_size)
    winners = {
        s: min(by_size[s].values(), key=lambda t: t.forward_s(layers) or math.inf) for s in ordered
    }
    main = _main_size(phase, sizes)
    head = winners.get(main, winners[ordered[-1]]).backend
    measure = MEASURE_OF[phase]

    def _noise(t: PhaseTiming) -> str:
        return "-" if t.noise_s is None else f"{t.noise_s * 1e3:.3f}"

    seen = ", ".join(
        f"{measure} {s}: {winners[s].backend} {(winners[s].forward_s(layers) or 0) * 1e3:.3f} ms"
        f" (noise {_noise(winners[s])})"
        for s in ordered
    )
    if len({w.backend for w in winners.values()}) == 1:
        why = f"one winner at every size ({seen})" if len(ordered) > 1 else seen
        return BucketDecision(phase, measure, head, (), head, tuple(ordered), why)
    limits: list[tuple[int, str]] = []
    for lo, hi in itertools.pairwise(ordered):
        a, b = winners[lo], winners[hi]
        if a.backend == b.backend:
            continue
        other_lo = by_size[lo].get(b.backend)
        other_hi = by_size[hi].get(a.backend)
        if (
            other_lo is None
            or other_hi is None
            or not _clearly_faster(a, other_lo, layers)
            or not _clearly_faster(b, other_hi, layers)
        ):
            # One backend for every size: the fastest over the sizes taken together.
            every = [n for n in by_size[ordered[0]] if all(n in by_size[s] for s in ordered)]
            total = {n: sum(by_size[s][n].forward_s(layers) or math.inf for s in ordered)
                     for n in every}  # fmt: skip
            best = min(every, key=lambda n: (total[n], n != head)) if every else head
            why = (
                f"no buckets: the winner changes between {measure} {lo} and {hi} by no more "
                f"than the noise ({seen}); chose {best}, the fastest over all sizes together "
                f"({', '.join(f'{n} {total[n] * 1e3:.3f} ms' for n in sorted(every))})"
            )
            return BucketDecision(phase, measure, head, (), best, tuple(ordered), why)
        limits.append((math.isqrt(lo * hi), a.backend))
    rest = winners[ordered[-1]].backend
    text = "|".join(f"{measure}<={bnd}:{n}" for bnd, n in limits) + f"|{rest}"
    why = f"buckets {text}: each change beats the noise ({seen})"
    return BucketDecision(phase, measure, head, tuple(limits), rest, tuple(ordered), why)


def _main_size(phase: str, sizes: TuneSizes) -> int:
    if phase == "prefill":
        return sizes.prefill_len
    if phase == "decode":
        return sizes.context
    return sizes.context + sizes.draft_tokens


def _spec_text(best: Mapping[Phase, BucketDecision]) -> str:
    from attn_dispatch._spec import BackendSpec

    text = {p: d.spec_text() for p, d in best.items()}
    if len(set(text.values())) == 1 and "|" not in text[Phase.PREFILL]:
        return text[Phase.PREFILL]
    return str(BackendSpec.parse(",".join(f"{p.name.lower()}={t}" for p, t in text.items())))


def tune(
    configs: Mapping[str, Any],
    *,
    sizes: TuneSizes | None = None,
    backends: Sequence[str] | None = None,
    registry: Any = None,
    phases: Sequence[Phase] = tuple(Phase),
) -> TuneReport:
    """Time every backend that can serve each group x phase; recommend the fastest per phase.

    ``configs`` maps a layer-group name to its ``AttnConfig`` (``{"": cfg}`` for a model
    with one kind of layer). ``backends`` limits the candidates (default: every registered
    backend available on this machine). MLA configs are timed in the absorbed form
    (``mha_head_dim`` is set aside): the form a backend picks for prefill is its own choice.
    """
    import torch

    from attn_dispatch._registry import DEFAULT_REGISTRY

    sizes = sizes or TuneSizes()
    if not isinstance(sizes, TuneSizes):
        raise InvalidSpecError("sizes", sizes, "pass a TuneSizes")
    if not isinstance(configs, Mapping) or not configs:
        raise InvalidSpecError("configs", configs, "pass a mapping group -> AttnConfig (>= 1)")
    for group, config in configs.items():
        check_device(config.device)
        check_memory(config, sizes, group=group)
    reg = registry or DEFAULT_REGISTRY
    listed = reg.list()
    unavailable: list[tuple[str, str]] = []
    if backends is None:
        names = [n for n, caps in listed.items() if not caps.availability_reasons()]
        unavailable = [
            (n, "; ".join(caps.availability_reasons()))
            for n, caps in listed.items()
            if caps.availability_reasons()
        ]
    else:
        if isinstance(backends, str) or not backends:
            raise InvalidSpecError(
                "backends", backends, f"name at least one backend (choose from {sorted(listed)!r})"
            )
        unknown = [n for n in backends if n not in listed]
        if unknown:
            raise InvalidSpecError("backends", unknown, f"choose from {sorted(listed)!r}")
        twice = sorted({n for n in backends if list(backends).count(n) > 1})
        if twice:
            raise InvalidSpecError("backends", twice, "name each backend once")
        names = list(backends)
    timings: list[PhaseTiming] = []
    recommended: dict[str, str] = {}
    device = "cpu"
    for group, config in configs.items():
        device = config.device
        if config.kind == "mla" and config.mha_head_dim is not None:
            config = dataclasses.replace(config, mha_head_dim=None, mha_v_head_dim=None)
        best: dict[Phase, BucketDecision] = {}
        # Buckets compare spreads: every cell gets at least two timed rounds.
        min_rounds = 2 if sizes.bucketed else 1
        for phase in phases:
            mine: list[PhaseTiming] = []
            for size in sizes.sizes_of(phase):
                at = sizes.at(phase, size)
                cells = [_time_one(group, config, phase, n, at, reg, min_rounds) for n in names]
                served = [c for c in cells if c.call_s is not None]
                served.sort(key=lambda c: c.forward_s(sizes.layers) or math.inf)
                mine.extend(served)
                mine.extend(c for c in cells if c.call_s is None)
            timings.extend(mine)
            got = decide(phase.name.lower(), mine, sizes)
            if got is not None:
                best[phase] = got
        if len(best) == len(phases) == len(Phase):
            recommended[group] = _spec_text(best)
        elif best:
            recommended[group] = ",".join(
                f"{p.name.lower()}={d.spec_text()}" for p, d in best.items()
            )
        else:
            recommended[group] = "(no backend can serve this group here)"
    return TuneReport(
        machine=machine_name(device),
        threads=torch.get_num_threads(),
        sizes=sizes,
        timings=tuple(timings),
        recommended=recommended,
        unavailable=dict(unavailable),
    )
