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
from typing import TYPE_CHECKING
from typing import Any

from hypothesis import strategies as st

from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import _registry
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import register_backend
from attn_dispatch.testing import strategies as _shipped

if TYPE_CHECKING:
    from attn_dispatch.testing.contract.cases import KernelCase
    from attn_dispatch.testing.contract.cases import Limits

# ---------------------------------------------------------------------------------------------
# Kernel cases: the contract kit's (attn_dispatch.testing.contract.cases), one definition.

# Loaded on first use: the kit's cases import torch, and this module stays torch-free.
_KIT_CASES = frozenset(
    {"DEFAULT_LIMITS", "KernelCase", "Limits", "Served", "kernel_cases", "split_cases",
     "trees", "variant_cases"}
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _KIT_CASES:
        from attn_dispatch.testing.contract import cases

        return getattr(cases, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@st.composite
def poisoned_cases(
    draw: Any, *, kind: str, limits: Limits | None = None
) -> tuple[KernelCase, tuple[int, ...], float | None, float | None]:
    """A kernel case in any phase with any variant (window, cap, sinks, FP8), trees whose
    mask may hide prefix keys, one protected query row per request, and the poison written
    into K and V of every slot that row cannot see (None: that tensor left clean)."""
    from attn_dispatch.testing.contract.cases import DEFAULT_LIMITS
    from attn_dispatch.testing.contract.cases import Served
    from attn_dispatch.testing.contract.cases import variant_cases

    limits = DEFAULT_LIMITS if limits is None else limits
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
