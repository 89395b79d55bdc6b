"""A small serving framework written for the isolation tests: leak patterns, replayed.

It adopts attn_dispatch (runners bind specs, forwards open ``attn_scope``, layers call
``attention``) but, like the frameworks of the bug family, it can still compute a runner's
choice from shared state. Each pattern is a pair: the buggy way (as the issue shows it) and
the fixed way (the runner owns what it dispatches with). ``Process`` stands for one serving
process: every workload makes a fresh one, so nothing leaks between workloads but what the
framework itself leaks inside one process.

Backends are torch-free echo backends registered by ``register_backends`` (inside a registry
snapshot): ``fa3``, ``flashinfer`` and ``triton``, each serving every config used here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import Binding
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from tests.strategies import FakeBatch
from tests.strategies import register_echo

# DeepSeek-like MLA target (absorbed: q/k 576 = latent 512 + rope 64, v 512) and an MHA draft.
TARGET_CONFIG = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64)
DRAFT_CONFIG = AttnConfig("mha", 8, 2, 128, dtype="bfloat16", page_size=64)
LAYERS = {"target": 4, "draft": 1}
DECODE_STEPS = 3


def register_backends() -> None:
    from attn_dispatch.backend import Capabilities

    # Every backend binds every config here: the leaks below pass bind's checks and change
    # only which kernel or shape runs (the kind of leak only an isolation test can see).
    caps = Capabilities(
        kinds={"mha", "mla"},
        devices={"cpu"},
        variants={"window", "logit_cap"},
    )
    for name in ("fa3", "flashinfer", "triton"):
        register_echo(name, caps, replace=True)


@dataclasses.dataclass
class ServerArgs:
    """The user's settings, as SGLang's ServerArgs: one object per process."""

    attention_backend: str = "fa3"
    speculative_draft_attention_backend: str = "flashinfer"
    page_size: int = 64
    kv_cache_dtype: str = "auto"


class Process:
    """One serving process and its process-wide state (what leaks live in)."""

    def __init__(self, args: ServerArgs | None = None) -> None:
        self.server_args = args or ServerArgs()
        # SGLang's global server args are read back by layers; vLLM's forward context holds
        # the current attention metadata and per-layer settings.
        self.forward_metadata: tuple[Binding, Any] | None = None
        self.layer_settings: dict[str, Any] = {}
        self.auto_backend: str | None = None


def forward(runner: Any, phase: Phase, layers: int) -> None:
    """One forward: its own scope and batch, ``layers`` attention calls."""
    with attn_scope(runner, FakeBatch(phase, kv_lens=(40, 70))):
        for _ in range(layers):
            attention(None, None, sm_scale=1.0)


def serve(runners: list[Any], steps: int = DECODE_STEPS) -> None:
    """A prefill of every runner, then decode steps (each runner in turn, the draft first:
    it proposes, the target checks)."""
    for r in runners:
        r.step(Phase.PREFILL)
    for _ in range(steps):
        for r in runners:
            r.step(Phase.DECODE)


class _Runner:
    label: str
    config: AttnConfig

    @property
    def attn_binding(self) -> Binding:
        raise NotImplementedError

    def step(self, phase: Phase) -> None:
        forward(self, phase, LAYERS[self.label])


# -- SGLang 28528: the draft's start-up writes the global backend the target reads lazily ---


class LazyGlobalRunner(_Runner):
    """BUGGY: binds at its first forward, reading the process-wide backend setting then."""

    def __init__(self, process: Process, label: str, config: AttnConfig) -> None:
        self.process, self.label, self.config = process, label, config
        self._binding: Binding | None = None

    @property
    def attn_binding(self) -> Binding:
        if self._binding is None:  # lazily, e.g. at CUDA-graph capture after every worker
            name = self.process.server_args.attention_backend
            self._binding = bind(BackendSpec.uniform(name), self.config, label=self.label)
        return self._binding


class GlobalWritingDraftWorker:
    """BUGGY: the draft worker's start-up overwrites the global backend with its own."""

    def __init__(self, process: Process) -> None:
        args = process.server_args
        args.attention_backend = args.speculative_draft_attention_backend
        self.runner = LazyGlobalRunner(process, "draft", DRAFT_CONFIG)

    def step(self, phase: Phase) -> None:
        self.runner.step(phase)


class OwnedSpecRunner(_Runner):
    """FIXED: the runner is given its spec at start-up and binds it then (SGLang PR 28559)."""

    def __init__(self, label: str, spec: BackendSpec | str, config: AttnConfig) -> None:
        self.label, self.config = label, config
        self._binding = bind(spec, config, label=label)

    @property
    def attn_binding(self) -> Binding:
        return self._binding


class OwnedSpecDraftWorker:
    """FIXED: the draft's spec comes from its own setting; no global is written."""

    def __init__(self, process: Process) -> None:
        name = process.server_args.speculative_draft_attention_backend
        self.runner = OwnedSpecRunner("draft", name, DRAFT_CONFIG)

    def step(self, phase: Phase) -> None:
        self.runner.step(phase)


def target_28528(process: Process, fixed: bool) -> _Runner:
    if fixed:
        return OwnedSpecRunner("target", process.server_args.attention_backend, TARGET_CONFIG)
    return LazyGlobalRunner(process, "target", TARGET_CONFIG)


def draft_28528(process: Process, fixed: bool) -> Any:
    return OwnedSpecDraftWorker(process) if fixed else GlobalWritingDraftWorker(process)


# -- Shared mutable config (SGLang 22682/29995, vLLM 52288): the draft adjusts the SAME args ---


class ArgsRunner(_Runner):
    """Derives its AttnConfig from the args object it was given, at its first forward."""

    def __init__(self, label: str, args: ServerArgs, base: AttnConfig) -> None:
        self.label, self.args, self.base = label, args, base
        self._binding: Binding | None = None

    @property
    def attn_binding(self) -> Binding:
        if self._binding is None:
            a = self.args
            kv = None if a.kv_cache_dtype == "auto" else a.kv_cache_dtype
            config = self.base.replace(page_size=a.page_size, kv_dtype=kv)
            self._binding = bind(BackendSpec.uniform(a.attention_backend), config, label=self.label)
        return self._binding


class AdjustingDraftWorker:
    """The draft's model-specific adjustment: one-token pages (EAGLE's top-k > 1 needs them)
    and its own backend.
    BUGGY (``copy=False``): it adjusts the target's args object (shared, not copied);
    FIXED: it adjusts a copy of its own."""

    def __init__(self, target_args: ServerArgs, *, copy: bool) -> None:
        args = dataclasses.replace(target_args) if copy else target_args
        args.page_size = 1
        args.attention_backend = args.speculative_draft_attention_backend
        self.runner = ArgsRunner("draft", args, DRAFT_CONFIG)

    def step(self, phase: Phase) -> None:
        self.runner.step(phase)


# -- Metadata of one runner reused by another (vllm-ascend 14791, vLLM 39775) ---------------


class MetadataRunner(OwnedSpecRunner):
    """Publishes its forward's attention metadata (binding, batch) in the process's forward
    context, as vLLM's ``set_forward_context`` does, and leaves it there after the forward.
    ``reuse=True`` (BUGGY): a forward that finds metadata there reuses it instead of building
    its own (the draft's prefill ran on the target's metadata)."""

    def __init__(
        self, process: Process, label: str, spec: str, config: AttnConfig, *, reuse: bool
    ) -> None:
        super().__init__(label, spec, config)
        self.process, self.reuse = process, reuse

    def step(self, phase: Phase) -> None:
        meta = self.process.forward_metadata if self.reuse else None
        if meta is None:
            meta = (self.attn_binding, FakeBatch(phase, kv_lens=(40, 70)))
            self.process.forward_metadata = meta
        binding, batch = meta
        with attn_scope(binding, batch):
            for _ in range(LAYERS[self.label]):
                attention(None, None, sm_scale=1.0)


# -- A lazily created runner reading a global (SGLang 34266, 32391) -------------------------


def resolve_auto(process: Process, config: AttnConfig) -> str:
    """The framework's "auto" backend for a config, remembered process-wide (the bug's seed)."""
    process.auto_backend = "fa3" if config.kind == "mla" else "triton"
    return process.auto_backend


class OverlapRunner(OwnedSpecRunner):
    """A target whose prefills run as two-batch-overlap halves, each half a child runner made
    on first use. BUGGY (``inherit=False``): a child binds the process's remembered "auto"
    backend, which the last runner to start wrote; FIXED: a child binds its parent's spec."""

    def __init__(self, process: Process, *, inherit: bool) -> None:
        super().__init__("target", resolve_auto(process, TARGET_CONFIG), TARGET_CONFIG)
        self.process, self.inherit = process, inherit
        self.children: list[OwnedSpecRunner] = []

    def step(self, phase: Phase) -> None:
        if phase is not Phase.PREFILL:
            return super().step(phase)
        if not self.children:  # made lazily, at the first prefill
            spec = self.attn_binding.spec if self.inherit else self.process.auto_backend
            assert spec is not None
            self.children = [OwnedSpecRunner("target", spec, TARGET_CONFIG) for _ in range(2)]
        for child in self.children:
            forward(child, phase, LAYERS["target"])


class AutoDraftWorker:
    def __init__(self, process: Process) -> None:
        self.runner = OwnedSpecRunner("draft", resolve_auto(process, DRAFT_CONFIG), DRAFT_CONFIG)

    def step(self, phase: Phase) -> None:
        self.runner.step(phase)


# -- A per-layer setting copied from the target into the draft (vLLM 13264) ------------------


class LayerModel:
    """A model whose attention layers register their settings in the process's per-layer
    context when built (vLLM's static forward context). ``window``/``cap``: the model's own."""

    def __init__(self, process: Process, window: int | None, cap: float | None) -> None:
        process.layer_settings.update(window_left=window, logit_cap=cap)
        self.window, self.cap = window, cap


class LayerSettingsDraft(OwnedSpecRunner):
    """An EAGLE-style draft layer. BUGGY (``from_context=True``): it takes its window and cap
    from the per-layer context, which holds the target's when the target was built first;
    FIXED: from its own model."""

    def __init__(self, process: Process, *, from_context: bool) -> None:
        own = LayerModel(process, None, None) if not from_context else None
        if from_context:
            s = process.layer_settings
            window, cap = s.get("window_left"), s.get("logit_cap")
        else:
            assert own is not None
            window, cap = own.window, own.cap
        config = DRAFT_CONFIG.replace(window_left=window, logit_cap=cap)
        super().__init__("draft", "fa3", config)


class WindowedTarget(OwnedSpecRunner):
    """A Gemma-2-like MHA target: sliding window 4096 keys and a soft-cap of 50."""

    def __init__(self, process: Process) -> None:
        model = LayerModel(process, 4095, 50.0)
        config = DRAFT_CONFIG.replace(num_q_heads=16, window_left=model.window, logit_cap=model.cap)
        super().__init__("target", "fa3", config)
