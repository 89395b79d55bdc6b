"""Hypothesis strategies for frameworks that test their use of attn_dispatch.

Needs hypothesis (``pip install attn_dispatch[testing]``); ``paged_batches`` needs torch too
(imported when a batch is drawn). Every strategy draws small values: a property over them
runs in seconds on a CPU, and shrinks to a readable case.

    from hypothesis import given
    from attn_dispatch.testing import strategies as ads

    @ads.small
    @given(config=ads.configs_for("native"), spec=ads.backend_specs(names=["native", "torch"]))
    def test_binds(config, spec): ...

- ``backend_specs``: ``BackendSpec`` values over the names given (or any valid names).
- ``attn_configs``: valid ``AttnConfig`` values (MHA/GQA and MLA, variants optional).
- ``configs_for(backend)``: configs a backend's declared ``Capabilities`` accept in every
  phase asked for (so ``bind`` succeeds on a machine where the backend is available).
- ``batch_layouts`` / ``paged_batches``: paged batches as plain data / as ``AttnBatch``:
  ragged requests, shuffled page tables, tree masks for VERIFY, window-trimmed tables, and
  one batch per group for grouped bindings.
- ``runner_sets``: a set of runners (a target, its draft, the draft's children...), each
  with a label, a spec and a config.
- ``small``: a ``settings`` that keeps all of this small (also registered as the profile
  ``"attn_dispatch.small"``).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._phase import Phase
from attn_dispatch._registry import DEFAULT_REGISTRY
from attn_dispatch._spec import BackendSpec
from attn_dispatch._vocab import COMPUTE_DTYPES
from attn_dispatch._vocab import FP8_DTYPES

#: Few examples, no deadline (a first call may compile or plan), and no health check for
#: slow draws (batches build tensors).
SMALL_PROFILE = "attn_dispatch.small"
settings.register_profile(
    SMALL_PROFILE,
    max_examples=25,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: The small settings as a decorator: ``@small`` above ``@given``.
small = settings.get_profile(SMALL_PROFILE)

phases = st.sampled_from(list(Phase))

#: Backend names as ``BackendSpec`` accepts them: no ',', '=' or whitespace, not empty.
backend_names = st.text(
    alphabet=string.ascii_letters + string.digits + "_-.:/+", min_size=1, max_size=12
)


def _names(names: Iterable[str] | st.SearchStrategy[str] | None) -> st.SearchStrategy[str]:
    if names is None:
        return backend_names
    if isinstance(names, st.SearchStrategy):
        return names
    pool = sorted(set(names))
    if not pool:
        raise ValueError("names: give at least one backend name")
    return st.sampled_from(pool)


@st.composite
def backend_specs(
    draw: st.DrawFn, names: Iterable[str] | st.SearchStrategy[str] | None = None
) -> BackendSpec:
    """A valid ``BackendSpec`` over ``names`` (a list, a strategy, or None for any valid
    name): verify given or following either ``verify_mode``."""
    pick = _names(names)
    return BackendSpec(
        prefill=draw(pick),
        decode=draw(pick),
        verify=draw(st.none() | pick),
        verify_mode=draw(st.sampled_from(["prefill", "decode"])),
    )


def _capabilities(backend: str | Capabilities) -> Capabilities:
    if isinstance(backend, Capabilities):
        return backend
    return DEFAULT_REGISTRY.get(backend, context="configs_for").capabilities


def _pick(draw: st.DrawFn, allowed: Iterable[Any] | None, default: Sequence[Any]) -> Any:
    pool = sorted(default if allowed is None else set(allowed) & set(default) or allowed)
    return draw(st.sampled_from(pool))


@st.composite
def attn_configs(
    draw: st.DrawFn,
    *,
    kinds: Sequence[str] = ("mha", "mla"),
    devices: Sequence[str] = ("cpu",),
    variants: bool = False,
    fp8: bool = False,
) -> AttnConfig:
    """A valid, small ``AttnConfig``: MHA with grouped-query heads or absorbed MLA; with
    ``variants=True`` also windows, soft caps, sinks and chunked or non-causal layers; with
    ``fp8=True`` also FP8 caches."""
    return draw(
        _config(
            Capabilities(
                kinds=set(kinds),
                devices=set(devices),
                kv_dtypes=set(COMPUTE_DTYPES) | (FP8_DTYPES if fp8 else set()),
                variants={"window", "logit_cap", "sinks", "chunked", "non_causal"}
                if variants
                else set(),
            ),
            tuple(Phase),
        )
    )


@st.composite
def _config(draw: st.DrawFn, caps: Capabilities, in_phases: tuple[Phase, ...]) -> AttnConfig:
    kind = _pick(draw, caps.kinds, ("mha", "mla"))
    device = draw(st.sampled_from(sorted(caps.devices)))
    dtype = _pick(draw, caps.dtypes, COMPUTE_DTYPES)
    kv_ok = caps.dtypes if caps.kv_dtypes is None else caps.kv_dtypes
    kv_choices = sorted({dtype} | ({*FP8_DTYPES} & set(kv_ok)))
    kv_dtype = draw(st.sampled_from(kv_choices)) if dtype in kv_ok else dtype
    page_size = _pick(draw, caps.page_sizes, (1, 8, 16, 64))
    served = frozenset.intersection(*(caps.variants_for(p) for p in in_phases))
    fields: dict[str, Any] = {}
    if kind == "mla":
        heads = draw(st.sampled_from((1, 2, 4, 8, 16)))
        if caps.head_dims is not None and caps.v_head_dims is not None:
            pairs = [(d, v) for d in caps.head_dims for v in caps.v_head_dims if v < d]
            head_dim, v_head_dim = draw(st.sampled_from(sorted(pairs) or [(576, 512)]))
        else:
            v_head_dim = draw(st.sampled_from((64, 128, 512)))
            head_dim = v_head_dim + draw(st.sampled_from((16, 64)))
        fields.update(num_q_heads=heads, num_kv_heads=1, head_dim=head_dim, v_head_dim=v_head_dim)
    else:
        kv_heads = draw(st.integers(1, 4))
        head_dim = _pick(draw, caps.head_dims, (32, 64, 128))
        fields.update(
            num_q_heads=kv_heads * draw(st.sampled_from((1, 2, 4))),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )
        if caps.v_head_dims is not None:
            fields["v_head_dim"] = _pick(draw, caps.v_head_dims, sorted(caps.v_head_dims))
    causal = True
    if "non_causal" in served and draw(st.integers(0, 3)) == 0:
        causal = False
    if causal and "window" in served and draw(st.booleans()):
        fields["window_left"] = draw(st.sampled_from((0, 3, 63, 4095)))
    if causal and "chunked" in served and draw(st.booleans()):
        fields["attention_chunk_size"] = draw(st.sampled_from((1, 16, 64)))
    if "logit_cap" in served and draw(st.booleans()):
        fields["logit_cap"] = draw(st.sampled_from((5.0, 30.0, 50.0)))
    if "sinks" in served and draw(st.booleans()):
        fields["sinks"] = True
    if caps.plans_scale or draw(st.booleans()):
        fields["sm_scale"] = fields["head_dim"] ** -0.5
    tree = Phase.VERIFY in in_phases and caps.custom_mask and draw(st.booleans())
    return AttnConfig(
        kind=kind,
        dtype=dtype,
        kv_dtype=kv_dtype,
        page_size=page_size,
        device=device,
        tree_verify=tree,
        causal=causal,
        **fields,
    )


def configs_for(
    backend: str | Capabilities,
    *,
    phases: Iterable[Phase | str] | None = None,
    device: str | None = None,
) -> st.SearchStrategy[AttnConfig]:
    """Configs the backend's declared capabilities accept in every phase of ``phases``
    (default: every phase the backend implements). ``backend``: a registered name (its
    capabilities are read now) or a ``Capabilities``. Checks the backend declares as
    functions (``Capabilities.checks``) are applied as a filter; machine facts (CUDA, a
    module) are not, so a CUDA backend's configs can be drawn on a CPU machine; ``device``
    (``"cpu"``, ``"cuda"``) keeps to one device type."""
    caps = _capabilities(backend)
    if device is not None:
        if device not in caps.devices:
            raise ValueError(f"the backend does not declare device {device!r} ({caps.devices!r})")
        caps = caps.replace(devices={device})
    wanted = tuple(Phase.parse(p) for p in phases) if phases is not None else None
    in_phases = tuple(p for p in Phase if p in caps.phases) if wanted is None else wanted
    if not in_phases:
        raise ValueError(f"the backend implements none of the phases asked for ({wanted!r})")
    return _config(caps, in_phases).filter(
        lambda c: not any(caps.config_reasons(c, p) for p in in_phases)
    )


@dataclasses.dataclass(frozen=True, slots=True)
class BatchLayout:
    """A paged batch as plain data (``AttnBatch.build``'s arguments): per request its new
    tokens, its tokens in the cache (the new ones included), its page table, and for VERIFY
    trees the parent of each draft token (-1: a child of the prefix)."""

    phase: Phase
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    page_size: int
    num_pages: int
    trees: tuple[tuple[int, ...], ...] | None = None

    def build(self, device: Any = "cpu") -> Any:
        """The ``AttnBatch`` (imports torch)."""
        from attn_dispatch._batch import AttnBatch
        from attn_dispatch._batch import tree_mask

        masks = None
        if self.trees is not None:
            masks = [
                tree_mask(list(t), prefix_len=k - q)
                for t, k, q in zip(self.trees, self.kv_lens, self.q_lens, strict=True)
            ]
        return AttnBatch.build(
            self.phase,
            q_lens=list(self.q_lens),
            kv_lens=list(self.kv_lens),
            page_tables=[list(t) for t in self.page_tables],
            page_size=self.page_size,
            num_pages=self.num_pages,
            masks=masks,
            device=device,
        )


@st.composite
def _requests(
    draw: st.DrawFn, phase: Phase, max_requests: int, max_q: int, max_prefix: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = draw(st.integers(1, max_requests))
    q_lens = tuple(1 if phase is Phase.DECODE else draw(st.integers(1, max_q)) for _ in range(n))
    low = 0 if phase is Phase.PREFILL else 1
    prefix = [draw(st.integers(low, max_prefix)) for _ in range(n)]
    return q_lens, tuple(p + q for p, q in zip(prefix, q_lens, strict=True))


@st.composite
def _layout(
    draw: st.DrawFn,
    phase: Phase,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    ps: int,
    trees: bool,
    window_left: int | None,
) -> BatchLayout:
    first_kept = [0] * len(q_lens)
    if window_left is not None:
        # The first query of a request sees keys from kv - q - window_left on: whole pages
        # before that one are evicted from a sliding group's cache.
        first_kept = [
            max(0, k - q - window_left) // ps for k, q in zip(kv_lens, q_lens, strict=True)
        ]
    counts = [-(-k // ps) - f for k, f in zip(kv_lens, first_kept, strict=True)]
    spare = draw(st.integers(0, 3))
    pool = draw(st.permutations(range(sum(counts) + spare)))
    tables, at = [], 0
    for c in counts:
        tables.append(tuple(pool[at : at + c]))
        at += c
    tree = None
    if phase is Phase.VERIFY and trees and draw(st.booleans()):
        tree = tuple(tuple(draw(st.integers(-1, j - 1)) for j in range(q)) for q in q_lens)
    # Over the kept pages, lengths count from the first kept page.
    kept = tuple(k - f * ps for k, f in zip(kv_lens, first_kept, strict=True))
    return BatchLayout(phase, q_lens, kept, tuple(tables), ps, len(pool), tree)


@st.composite
def batch_layouts(
    draw: st.DrawFn,
    *,
    phase: Phase | None = None,
    page_size: int | None = None,
    max_requests: int = 4,
    max_q: int = 12,
    max_prefix: int = 80,
    trees: bool = True,
    window_left: int | None = None,
) -> BatchLayout:
    """A small paged batch as plain data: 1..``max_requests`` requests of different lengths,
    pages handed out shuffled (page tables are not ranges), a few spare pages. VERIFY
    batches may get tree parents when ``trees``; with ``window_left``, each page table keeps
    only the pages the window can still see (a sliding group's cache: whole pages before the
    window are gone, and the batch's lengths count from its first kept page)."""
    phase = draw(phases) if phase is None else phase
    ps = draw(st.sampled_from((1, 4, 16))) if page_size is None else page_size
    q_lens, kv_lens = draw(_requests(phase, max_requests, max_q, max_prefix))
    return draw(_layout(phase, q_lens, kv_lens, ps, trees, window_left))


@dataclasses.dataclass(frozen=True, slots=True)
class GroupBatches:
    """One forward's batches, one per group of a grouped binding (what ``attn_scope``
    plans each group with: the ``group_batches`` attribute)."""

    phase: Phase
    group_batches: Mapping[str, Any]


@st.composite
def paged_batches(
    draw: st.DrawFn,
    config: AttnConfig | Mapping[str, AttnConfig],
    *,
    phase: Phase | None = None,
    device: Any = "cpu",
    max_requests: int = 4,
    max_q: int = 12,
    max_prefix: int = 80,
) -> Any:
    """An ``AttnBatch`` for ``config`` (its page size; tree masks only where the config
    verifies with trees), or, for a mapping group -> config, one batch per group over the
    same requests (a windowed group's tables trimmed to its window) in a ``GroupBatches``.
    Needs torch."""
    phase = draw(phases) if phase is None else phase
    q_lens, kv_lens = draw(_requests(phase, max_requests, max_q, max_prefix))
    if isinstance(config, AttnConfig):
        layout = draw(_layout(phase, q_lens, kv_lens, config.page_size, config.tree_verify, None))
        return layout.build(device)
    if not config:
        raise ValueError("paged_batches: a grouped config needs at least one group")
    out = {}
    for name in sorted(config):
        cfg = config[name]
        layout = draw(_layout(phase, q_lens, kv_lens, cfg.page_size, False, cfg.window_left))
        out[name] = layout.build(device)
    return GroupBatches(phase, out)


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerPlan:
    """One runner of a set: its label, spec and config (bind it with ``bind(spec, config,
    label=label)``)."""

    label: str
    spec: BackendSpec
    config: AttnConfig


@st.composite
def runner_sets(
    draw: st.DrawFn,
    names: Iterable[str],
    *,
    configs: st.SearchStrategy[AttnConfig] | None = None,
    max_children: int = 2,
) -> tuple[RunnerPlan, ...]:
    """A set of runners as a server holds them: a ``"target"``, often a ``"draft"``, and up
    to ``max_children`` of the draft's per-step children (``"draft.step<i>"``), each with its
    own spec over ``names`` and its own config (``configs``, default ``attn_configs()``).
    Labels are distinct; bind each where your framework would."""
    pick = list(names)
    config_strategy = attn_configs() if configs is None else configs
    runners = [RunnerPlan("target", draw(backend_specs(pick)), draw(config_strategy))]
    if draw(st.integers(0, 3)) > 0:
        runners.append(RunnerPlan("draft", draw(backend_specs(pick)), draw(config_strategy)))
        for i in range(draw(st.integers(0, max_children))):
            runners.append(
                RunnerPlan(f"draft.step{i}", draw(backend_specs(pick)), draw(config_strategy))
            )
    return tuple(runners)


__all__ = [
    "SMALL_PROFILE",
    "BatchLayout",
    "GroupBatches",
    "RunnerPlan",
    "attn_configs",
    "backend_names",
    "backend_specs",
    "batch_layouts",
    "configs_for",
    "paged_batches",
    "phases",
    "runner_sets",
    "small",
]
