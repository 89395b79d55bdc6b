"""Hypothesis strategies for the whole test suite (one module, as the style guide asks), and
the small torch-free test backends the dispatch tests draw from.

Echo backends: their handlers return an identifying tuple instead of a tensor, so a test can
tell from a call's result exactly which runner, phase and backend object served it. Register
them inside the ``registry_snapshot`` fixture (tests/conftest.py) or a ``RegistrySnapshot``, so
the global registry is restored afterwards.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from hypothesis import strategies as st

from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import _registry
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import register_backend
from attn_dispatch.testing import strategies as _shipped

# ---------------------------------------------------------------------------------------------
# Kernel cases for the contract suite. A case is plain data; tests/contract/cases.py turns it
# into tensors with a seeded generator, so a failing example is reproducible from its repr.


@dataclasses.dataclass(frozen=True)
class Limits:
    """Size limits per backend (the triton interpreter needs tiny shapes)."""

    max_requests: int = 8
    max_q: int = 40
    max_prefix: int = 300
    page_sizes: tuple[int, ...] = (1, 16, 64)
    gqa_ratios: tuple[int, ...] = (1, 2, 4, 8)
    max_kv_heads: int = 2
    mha_dims: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (192, 128))
    mla_dims: tuple[tuple[int, int], ...] = ((576, 512), (80, 64))
    mla_heads: tuple[int, ...] = (1, 2, 4, 16)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # Tree (custom-mask) verify for MLA; FlashInfer's MLA path has no custom mask.
    mla_trees: bool = True


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kind: str
    phase: Phase
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: str
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    # For VERIFY: per request, parent index of each draft token (-1 = child of the prefix),
    # or None for a causal chain.
    trees: tuple[tuple[int, ...], ...] | None
    extra_pages: int
    seed: int
    # Layer variants and the FP8 cache (defaults: none; see variant_cases).
    window_left: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    kv_dtype: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    # With trees: per request, prefix positions its custom mask hides from every draft node
    # (a mask that is not a plain tree; the window then counts only the keys it allows).
    hidden_prefix: tuple[tuple[int, ...], ...] | None = None
    # Attention types: non-causal (every key of the request) and chunked local attention.
    causal: bool = True
    chunk: int | None = None
    # The attention state: the config has return_lse=True and the call asks for (out, lse).
    lse: bool = False

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.q_lens, strict=True))


@st.composite
def trees(draw: Any, size: int) -> tuple[int, ...]:
    """Parents of ``size`` draft tokens; each parent precedes its child."""
    return tuple(draw(st.integers(-1, j - 1)) for j in range(size))


@st.composite
def kernel_cases(
    draw: Any, *, kind: str, phase: Phase, limits: Limits = DEFAULT_LIMITS
) -> KernelCase:
    n = draw(st.integers(1, limits.max_requests))
    if kind == "mla":
        head_dim, v_head_dim = draw(st.sampled_from(limits.mla_dims))
        hq, hkv = draw(st.sampled_from(limits.mla_heads)), 1
    else:
        head_dim, v_head_dim = draw(st.sampled_from(limits.mha_dims))
        hkv = draw(st.integers(1, limits.max_kv_heads))
        hq = hkv * draw(st.sampled_from(limits.gqa_ratios))
    if phase is Phase.DECODE:
        q_lens = (1,) * n
    else:
        q_lens = tuple(draw(st.integers(1, limits.max_q)) for _ in range(n))
    prefix_lens = tuple(draw(st.integers(0, limits.max_prefix)) for _ in range(n))
    tree = None
    trees_ok = kind != "mla" or limits.mla_trees
    if phase is Phase.VERIFY and trees_ok and draw(st.booleans()):
        tree = tuple(draw(trees(q)) for q in q_lens)
    return KernelCase(
        kind=kind,
        phase=phase,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_size=draw(st.sampled_from(limits.page_sizes)),
        dtype=draw(st.sampled_from(limits.dtypes)),
        q_lens=q_lens,
        prefix_lens=prefix_lens,
        trees=tree,
        extra_pages=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclasses.dataclass(frozen=True)
class Served:
    """What of the variants and FP8 formats one backend serves for one (kind, phase)."""

    variants: frozenset[str] = frozenset()
    fp8: tuple[str, ...] = ()


@st.composite
def variant_cases(
    draw: Any, *, kind: str, phase: Phase, served: Served, limits: Limits = DEFAULT_LIMITS
) -> KernelCase:
    """``kernel_cases`` plus the variants and FP8 caches in ``served``: windows from 0 to
    larger than any context, caps from tight (0.5, most scores saturate) to loose, sinks,
    FP8 caches in both formats with scales other than 1, and the attention types: chunks
    from 1 to larger than any context, and non-causal layers (never with a window or chunk);
    and the attention state (``lse``) where served."""
    base = draw(kernel_cases(kind=kind, phase=phase, limits=limits))
    window = cap = None
    if "window" in served.variants and draw(st.booleans()):
        window = draw(st.sampled_from((0, 1, 3)) | st.integers(0, 64) | st.just(100_000))
    if "logit_cap" in served.variants and draw(st.booleans()):
        cap = draw(st.sampled_from((0.5, 2.0, 30.0)))
    sinks = "sinks" in served.variants and draw(st.booleans())
    chunk, causal = None, True
    if "chunked" in served.variants and draw(st.booleans()):
        chunk = draw(st.sampled_from((1, 3, 16)) | st.integers(1, 80) | st.just(100_000))
    if "non_causal" in served.variants and window is None and chunk is None:
        causal = draw(st.integers(0, 3)) != 0  # non-causal one time in four
    kv_dtype, k_scale, v_scale = None, 1.0, 1.0
    if served.fp8 and draw(st.booleans()):
        kv_dtype = draw(st.sampled_from(served.fp8))
        k_scale = draw(st.sampled_from((0.25, 0.5, 1.0, 3.0)))
        v_scale = k_scale if kind == "mla" else draw(st.sampled_from((0.125, 1.0, 2.0)))
    lse = "lse" in served.variants and draw(st.booleans())  # the state, checked too
    return dataclasses.replace(
        base,
        lse=lse,
        window_left=window,
        logit_cap=cap,
        sinks=sinks,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        causal=causal,
        chunk=chunk,
    )


@st.composite
def poisoned_cases(
    draw: Any, *, kind: str, limits: Limits = DEFAULT_LIMITS
) -> tuple[KernelCase, tuple[int, ...], float | None, float | None]:
    """A kernel case in any phase with any variant (window, cap, sinks, FP8), trees whose
    mask may hide prefix keys, one protected query row per request, and the poison written
    into K and V of every slot that row cannot see (None: that tensor left clean)."""
    phase = draw(st.sampled_from(list(Phase)))
    served = Served(
        variants=frozenset({"window", "logit_cap", "sinks", "non_causal", "chunked"}),
        fp8=("float8_e4m3fn", "float8_e5m2"),
    )
    case = draw(variant_cases(kind=kind, phase=phase, served=served, limits=limits))
    if case.trees is not None and draw(st.booleans()):
        hidden = tuple(
            tuple(sorted(draw(st.sets(st.integers(0, p - 1), max_size=p)))) if p else ()
            for p in case.prefix_lens
        )
        case = dataclasses.replace(case, hidden_prefix=hidden)
    protect = tuple(draw(st.integers(0, q - 1)) for q in case.q_lens)
    values = st.sampled_from((float("nan"), float("inf"), float("-inf")))
    k_val = draw(st.none() | values)
    v_val = draw(values) if k_val is None else draw(st.none() | values)
    return case, protect, k_val, v_val


# ---------------------------------------------------------------------------------------------
# Dispatch tests: registry snapshots, echo backends, configs, specs.

_ids = itertools.count()


class RegistrySnapshot:
    """Saves the registry's internals and puts them back (the ``registry_snapshot`` fixture of
    tests/conftest.py uses it; so do state machines, which cannot use function fixtures)."""

    def __init__(self) -> None:
        reg = _registry.DEFAULT_REGISTRY
        reg._ensure_loaded()
        with reg._lock:
            self.entries = dict(reg._entries)
            self.origins = dict(reg._origins)
            self.plugin_errors = dict(reg.plugin_errors)

    def restore(self) -> None:
        reg = _registry.DEFAULT_REGISTRY
        with reg._lock:
            reg._entries.clear()
            reg._entries.update(self.entries)
            reg._origins.clear()
            reg._origins.update(self.origins)
            reg.plugin_errors.clear()
            reg.plugin_errors.update(self.plugin_errors)


@dataclasses.dataclass(frozen=True, slots=True)
class EchoHandler:
    """A handler that returns who it is: ``(backend name, phase, backend object id, plan)``."""

    backend: str
    phase: Phase
    instance: int

    def __call__(self, q: Any, k_cache: Any, v_cache: Any, plan: Any, sm_scale: float) -> Any:
        return (self.backend, self.phase, self.instance, plan)


class EchoBackend(BackendBase):
    """A torch-free backend: ``plan`` counts its calls; handlers echo their identity.

    For MLA configs it serves the absorbed form only (no decompressed handlers to fake).
    """

    def __init__(self, config: AttnConfig, *, name: str = "echo", **options: Any) -> None:
        self.name = name
        self.config = config
        self.options = options
        self.instance = next(_ids)
        self.plans: list[Any] = []
        self.handler_calls: list[Phase] = []

    def plan(self, batch: Any) -> Any:
        self.plans.append(batch)
        return ("plan", self.name, self.instance, len(self.plans))

    def handler(self, phase: Phase) -> EchoHandler:
        self.handler_calls.append(phase)
        return EchoHandler(self.name, phase, self.instance)


class _HostLens(tuple[int, ...]):
    def sum(self) -> int:  # what FormPolicy.choose reads of an AttnBatch's host tensor
        return sum(self)


@dataclasses.dataclass(frozen=True, slots=True)
class FakeBatch:
    """What attn_scope needs of a batch without torch: its phase (and, for an MLA binding's
    form policy, the host-side lengths)."""

    phase: Phase
    kv_lens: tuple[int, ...] = (1,)
    num_tokens: int = 1

    @property
    def kv_lens_host(self) -> _HostLens:
        return _HostLens(self.kv_lens)


def echo_factory(name: str) -> Any:
    def make(config: AttnConfig, **options: Any) -> EchoBackend:
        return EchoBackend(config, name=name, **options)

    make.__qualname__ = f"echo_factory({name!r})"
    return make


ANY_CAPS = Capabilities(kinds={"mha", "mla"}, devices={"cpu", "cuda"})
MHA_ONLY_CAPS = Capabilities(kinds={"mha"}, devices={"cpu"})


def register_echo(
    name: str, capabilities: Capabilities = ANY_CAPS, *, replace: bool = False
) -> None:
    """Register an EchoBackend under ``name`` (call inside a registry snapshot)."""
    register_backend(name, capabilities=capabilities, factory=echo_factory(name), replace=replace)


def mha_config(**changes: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha", num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="float32", device="cpu"
    )
    base.update(changes)
    return AttnConfig(**base)


def mla_config(**changes: Any) -> AttnConfig:
    """DeepSeek-like absorbed MLA: 16 heads, 576 = 512 latent + 64 rope, bf16."""
    base: dict[str, Any] = dict(
        kind="mla",
        num_q_heads=16,
        num_kv_heads=1,
        head_dim=576,
        v_head_dim=512,
        dtype="bfloat16",
        device="cpu",
    )
    base.update(changes)
    return AttnConfig(**base)


# ---------------------------------------------------------------------------------------------
# strategies

# The shipped strategies (attn_dispatch.testing.strategies) are the suite's own: one
# definition of a valid name, spec and config, tested where frameworks use them.
phases = _shipped.phases
backend_names = _shipped.backend_names
backend_specs = _shipped.backend_specs


def attn_configs() -> st.SearchStrategy[AttnConfig]:
    """Every valid config shape the shipped strategy draws: MHA (GQA) and absorbed MLA, with
    layer variants and FP8 caches."""
    return _shipped.attn_configs(variants=True, fp8=True)


# ---------------------------------------------------------------------------------------------
# Adversarial batches (tests/adversarial/test_backends_child_process.py): a valid paged
# batch, then edits a buggy caller could make to its tensors, before or after planning, plus
# mismatched q rows, v_cache pages and plans from other runners.

_EDITABLE = ("kv_indices", "kv_lens", "kv_indptr", "qo_indptr")


@st.composite
def malformed_scenarios(draw: Any, num_pages: int, page_size: int) -> dict[str, Any]:
    """One adversarial scenario as plain data (see ``property_malformed``)."""
    b = draw(st.integers(0, 3))
    phase = draw(st.sampled_from([Phase.DECODE, Phase.PREFILL]))
    q_lens = [1 if phase is Phase.DECODE else draw(st.integers(1, 3)) for _ in range(b)]
    kv_lens = [q + draw(st.integers(0, 6)) for q in q_lens]
    pages = st.integers(0, num_pages - 1)
    tables = [
        [draw(pages) for _ in range(-(-n // page_size) + draw(st.integers(0, 1)))] for n in kv_lens
    ]
    edit = st.tuples(st.sampled_from(_EDITABLE), st.integers(0, 8), st.integers(-3, 40))
    return dict(
        phase=phase,
        q_lens=q_lens,
        kv_lens=kv_lens,
        tables=tables,
        edits=draw(st.lists(edit, max_size=3)),
        when=draw(st.sampled_from(["before_plan", "after_plan"])),
        rows=draw(st.integers(-1, 1)),
        v_pages=draw(st.sampled_from([num_pages, num_pages - 1])),
        plan_from=draw(st.sampled_from(["own", "own", "own", "big", "ps8"])),
        no_page_size=draw(st.booleans()),
    )


# ---------------------------------------------------------------------------------------------
# Cascade (shared-prefix) batches for tests/backends/native/test_cascade.py: page tables
# that share leading pages in every way the planner must tell apart.


@dataclasses.dataclass(frozen=True)
class CascadeCase:
    """A decode or verify batch whose page tables may share leading pages (plain data)."""

    page_size: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    num_pages: int
    tree: bool  # verify with a random custom mask over the drafted tokens
    kind: str = "mha"
    num_q_heads: int = 4
    num_kv_heads: int = 2
    sinks: bool = False
    logit_cap: float | None = None
    kv_dtype: str | None = None
    seed: int = 0


@st.composite
def cascade_cases(draw: Any) -> CascadeCase:
    """Requests that share all, part or none of a common prefix of pages; some hold the
    shared pages at another position (not a prefix: no cascade for them); some have no own
    page (every key shared); some read only part of their last page."""
    ps = draw(st.sampled_from((8, 16)))
    n = draw(st.integers(2, 6))
    verify = draw(st.booleans())
    q_lens = tuple(draw(st.integers(1, 3)) if verify else 1 for _ in range(n))
    # At least 64 keys (the planner's floor) most of the time.
    prefix_pages = draw(
        st.sampled_from((0, 1, 1, 1)).flatmap(
            lambda small: st.integers(1, 3) if not small else st.integers(64 // ps, 10)
        )
    )
    prefix = list(range(prefix_pages))
    next_page = prefix_pages
    tables, kv_lens = [], []
    for q_len in q_lens:
        how = draw(st.sampled_from(("all",) * 5 + ("some", "none")))
        shared = {"all": prefix_pages, "none": 0}.get(how) or draw(st.integers(0, prefix_pages))
        own = draw(st.integers(0 if shared else 1, 3))
        mine = list(range(next_page, next_page + own))
        next_page += own
        layout = draw(st.sampled_from(("prefix",) * 5 + ("after",)))
        table = mine + prefix[:shared] if layout == "after" else prefix[:shared] + mine
        full = len(table) * ps
        # Whole pages, or part of the last page (at least q_len keys in all).
        kv_len = max(q_len, full - draw(st.integers(0, ps - 1)))
        tables.append(tuple(table))
        kv_lens.append(kv_len)
    kind = draw(st.sampled_from(("mha", "mha", "mla")))
    hkv = 1 if kind == "mla" else draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2, 4)))
    return CascadeCase(
        page_size=ps,
        q_lens=q_lens,
        kv_lens=tuple(kv_lens),
        tables=tuple(tables),
        num_pages=next_page + draw(st.integers(0, 2)),
        tree=verify and draw(st.booleans()),
        kind=kind,
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        sinks=draw(st.booleans()),
        logit_cap=draw(st.sampled_from((None, None, 5.0))),
        kv_dtype=draw(st.sampled_from((None, None, "float8_e4m3fn"))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# The attention state (issue 24): cases whose keys split into two disjoint sets, for the merge
# tests of tests/contract/test_lse.py.


@st.composite
def split_cases(
    draw: Any, *, kind: str, served: Served, limits: Limits = DEFAULT_LIMITS
) -> tuple[KernelCase, tuple[int, ...]]:
    """A case with ``lse=True`` whose every query sees every key of its request (decode, or a
    non-causal prefill/verify when served), so its keys split at any page boundary into two
    sets that each give a valid batch: and the cut, pages in the first part, per request.
    Each part holds at least ``q_len`` keys; caps, sinks and FP8 as ``served`` allows
    (position-dependent variants, window and chunk, do not split this way)."""
    non_causal = "non_causal" in served.variants and draw(st.booleans())
    phase = draw(st.sampled_from([Phase.PREFILL, Phase.VERIFY])) if non_causal else Phase.DECODE
    splittable = Served(variants=served.variants & {"logit_cap", "sinks"}, fp8=served.fp8)
    case = draw(variant_cases(kind=kind, phase=phase, served=splittable, limits=limits))
    ps = case.page_size
    cuts, prefixes = [], []
    for q in case.q_lens:
        cut = -(-q // ps) + draw(st.integers(0, 1))  # whole pages, at least q keys
        room = max(limits.max_prefix - cut * ps, 0)
        cuts.append(cut)
        prefixes.append(cut * ps + draw(st.integers(0, room)))  # the second part: >= q keys
    case = dataclasses.replace(
        case, prefix_lens=tuple(prefixes), trees=None, causal=not non_causal, lse=True
    )
    return case, tuple(cuts)
