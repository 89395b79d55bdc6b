"""vLLM's CPU engine: tokens/s with attn_dispatch ``native`` vs vLLM's own CPU attention.

    .venv-vllm/bin/python bench/vllm_cpu.py [--model bench|tiny|long|both] [--rounds 2]
        [--layers 4] [--mixed] [--spec [--no-eagle]] [--dtype bfloat16|float32] [--breakdown]
        [--phases [--cpu-time]]
    .venv-vllm/bin/python bench/vllm_cpu.py --quick   # smoke run, writes nothing

One process, random Llama-shaped models (bf16, saved with transformers at start; ``--model``:
``bench``, hidden 1024, GQA 16/4 x 64; ``tiny``, issue 36's hidden 256, GQA 4/2 x 64; both by
default, one after the other; ``long``, hidden 1024, MLP 2816, GQA 8/2 x 128), the same
prompts for every contender: batch 8 x 128-token prompts, 64 new tokens each, greedy (for
``long``: 4 x 2048-token prompts, 64 new).
The contenders take turns (round 1: each once, round 2: each again in the reverse order, ...)
and the best round of each is reported, so a burst of other load lands on all of them alike.
``x vllm per round``: the ratio of the two engines' times within each round, its median and
range over the rounds; the steadier figure where the machine's speed drifts between rounds
(best-of compares each side's luckiest round). tokens/s = new tokens
/ wall time of ``llm.generate`` (start-up excluded; each engine first generates 4 tokens
for the same prompts: the first run of each batch shape builds vLLM's oneDNN kernels, and
prefix caching is off). ``attention s``: the time spent in the attention layers (KV writes
and forwards) during that generate, measured the same way for every contender. ``tokens as
vllm's``: tokens equal to vLLM's up to each request's first difference (in bf16 a near-tie
may flip and greedy decoding diverges from there; ``--dtype float32`` compares exactly).
``x vllm, attention free``: the row's ``x vllm`` if its attention layers took no time (vLLM's
own generate over the row's time outside attention): the most any attention kernel can give
that row. ``attention x for 1.3x``: how many times faster than vLLM's own attention layers
the row's must be for 1.3x vLLM's tokens/s, its time outside attention as measured
("unreachable" where that time alone is longer); ``attention s for 1.3x``: the attention
time that allows. ``prefill floor s``: the causal multiply-adds of the prompts' prefill in
every attention layer the row runs (target and draft; q.K^T and p.V over each prompt's
L(L+1)/2 query-key pairs) at the GEMM peak measured after the engines in the same process
(the faster of torch's fp32 and bf16 1024^3 matmul): no attention kernel on this machine
takes less, so a row whose ``attention s for 1.3x`` is below it cannot reach 1.3x whatever
kernel serves it.

Rows (each ``x vllm`` is against vLLM's own attention in the same set-up: ``native, eagle``
against ``vllm, eagle``):

- ``vllm``: vLLM's CPU attention (its kernel ISA named: "vec" on AVX2 x86, "amx" with AMX).
- ``native``: ``additional_config={"attn_dispatch": {"target": "native"}}``.
- ``prefill=sdpa,decode=native``: the same with that spec (PyTorch's fused attention for
  prefill, native for decode).
- ``*, mixed`` (``--mixed``): the same with ``max_num_batched_tokens=256``, so the 128-token
  prompts prefill in chunks while earlier requests decode: steps mix phases. ``native split``
  makes one call per phase per layer, ``native extend`` one prefill call for the whole step.
- ``*, draft_model`` and ``*, eagle`` (``--spec``): speculative decoding, 3 tokens a step,
  with a 1-layer draft of the model's shape (its own random weights) and with a random
  EAGLE-1 head; ``native`` runs target and draft on native (``{"target": "native", "draft":
  "native"}``). Random drafts are rarely accepted: the rows time the draft and verify passes
  more than a useful speed-up. A method vLLM cannot build here is reported with its error.

Writes ``bench/results/vllm_cpu.json`` (``vllm_cpu_<model>[_spec][_float32].json`` for
another selection).

``--breakdown``: where a step's time goes around the kernels, vLLM's own attention against
``native`` in one run (``StepClock``): per step, the metadata build (for the plugin: of
which ``step_parts``, its batch building from vLLM's tensors), the KV writes, and every
layer's attention call (for the plugin: of which ``Binding.prepare`` and the ``attention()``
call through the scope; the rest is the scope, slicing and copies). Writes
``bench/results/vllm_cpu_breakdown_<model>.json``. Its ``step`` is the timed generate's wall
time over its steps (the prefill step included): the same quantity as tokens/s.

``--phases``: where the timed generate's time goes (``PhaseClock``), vLLM's own attention
against ``native`` and ``native`` on one thread (``"options": {"native": {"num_threads":
1}}``), the order reversed every other round: the prefill step, the decode steps (the model
runner's ``execute_model``, of which the model's forward, the attention layers and the
metadata build; ``sample_tokens``; garbage collection) and the rest of the generate. With
``--cpu-time``, the calling thread's CPU time instead of wall time: run it with
``OMP_NUM_THREADS=1`` (the whole step then runs on that thread), so that a burst of other
load on a shared machine does not land in one contender's figure. Writes
``bench/results/vllm_cpu_phases_<model>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from typing import ClassVar

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, PROMPT, NEW = 8, 128, 64


#: Model shapes (``--model``): hidden size, intermediate size, query heads, KV heads, head
#: size; vocabulary 2048. ``bench``: this script's own; ``tiny``: issue 36's small Llama,
#: where the per-step costs around the kernels weigh most; ``long``: a Llama-shaped model
#: with head size 128 for the long-context rows (``LENGTHS``).
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "bench": (1024, 2048, 16, 4, 64),
    "tiny": (256, 512, 4, 2, 64),
    "long": (1024, 2816, 8, 2, 128),
}
#: Shape -> (requests, prompt tokens, new tokens) of its runs (``BATCH``, ``PROMPT``, ``NEW``
#: otherwise): the long-context rows are 4 prompts of 2048 tokens + 64 new.
LENGTHS: dict[str, tuple[int, int, int]] = {"long": (4, 2048, 64)}
#: Speculative rows (``--spec``): the proposals per step of both methods.
SPEC_TOKENS = 3


def lengths(shape: str) -> tuple[int, int, int]:
    """(requests, prompt tokens, new tokens) of a shape's runs."""
    return LENGTHS.get(shape, (BATCH, PROMPT, NEW))


def shape_text(shape: str, layers: int) -> str:
    hidden, _, qh, kvh, hd = SHAPES[shape]
    batch, prompt, new = lengths(shape)
    return (
        f"{shape}: {layers} layers, hidden {hidden}, GQA {qh}/{kvh} x {hd}, batch {batch} x "
        f"{prompt}-token prompts, {new} new"
    )


def _llama_config(shape: str, layers: int) -> Any:
    import transformers

    hidden, inter, qh, kvh, hd = SHAPES[shape]
    return transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=qh,
        num_key_value_heads=kvh,
        head_dim=hd,
        max_position_embeddings=4096,
    )


def make_model(root: Path, layers: int, shape: str = "bench", name: str = "llama") -> str:
    """A random bf16 Llama of ``shape`` with ``layers`` layers, saved under ``root``."""
    import torch
    import transformers

    torch.manual_seed(0 if name == "llama" else 1)
    model: Any = transformers.LlamaForCausalLM(_llama_config(shape, layers))
    model = model.to(torch.bfloat16).eval()
    path = root / f"{name}_{shape}"
    model.save_pretrained(path)
    return str(path)


def make_eagle_head(root: Path, shape: str) -> str:
    """A random EAGLE-1 head for the ``shape`` target, as vLLM reads one: ``fc`` over (token
    embedding, target hidden state) and one decoder layer without ``input_layernorm``; the
    embeddings and LM head are the target's."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, qh, kvh, hd = SHAPES[shape]
    g = torch.Generator().manual_seed(2)

    def rand(*size: int) -> Any:
        return (torch.randn(*size, generator=g) * 0.02).to(torch.bfloat16)

    pre = "layers.0."
    weights = {
        "fc.weight": rand(hidden, 2 * hidden),
        f"{pre}self_attn.q_proj.weight": rand(qh * hd, hidden),
        f"{pre}self_attn.k_proj.weight": rand(kvh * hd, hidden),
        f"{pre}self_attn.v_proj.weight": rand(kvh * hd, hidden),
        f"{pre}self_attn.o_proj.weight": rand(hidden, qh * hd),
        f"{pre}mlp.gate_proj.weight": rand(inter, hidden),
        f"{pre}mlp.up_proj.weight": rand(inter, hidden),
        f"{pre}mlp.down_proj.weight": rand(hidden, inter),
        f"{pre}post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    config = _llama_config(shape, 1).to_dict()
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    path = root / f"eagle_{shape}"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


def load_text() -> str:
    """``/proc/loadavg``'s three averages (printed with every figure: a shared machine)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def isa_names() -> tuple[str, str]:
    """(vLLM's CPU attention kernel ISA and library build, native's ISA path)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from attn_dispatch.backends.native._lib import load

    vllm_isa = _get_attn_isa(torch.bfloat16, 128, 64)
    if torch.cpu._is_avx512_bf16_supported():
        build = "_C"
    elif torch.cpu._is_avx512_supported():
        build = "_C_AVX512"
    else:
        build = "_C_AVX2"
    lib = load()
    native = lib if isinstance(lib, str) else lib.isa
    return f"{vllm_isa} ({build})", native


_CLOCKS: dict[type, Any] = {}


def _once(cls: type) -> Any:
    """One clock of each kind per process: each wraps class attributes, and wrapping twice
    would count every call twice."""
    if cls not in _CLOCKS:
        _CLOCKS[cls] = cls()
    return _CLOCKS[cls]


class AttentionClock:
    """Seconds spent in the attention layers' KV writes and forwards (both contenders run
    through ``AttnDispatchCPUImpl``: the plugin is registered, and without the config key it
    hands each call to vLLM's own implementation)."""

    def __init__(self) -> None:
        from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

        self.seconds = 0.0
        for name in ("forward", "do_kv_cache_update"):
            setattr(AttnDispatchCPUImpl, name, self._timed(getattr(AttnDispatchCPUImpl, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


class StepClock:
    """Where a step's time goes around the kernels (``--breakdown``): seconds per bucket,
    measured by wrapping the plugin's entry points (buckets nest; see ``BUCKETS``). Both
    contenders run through the plugin's classes; vLLM's own rows fill ``build``,
    ``forward`` and ``kv write`` only (its builder and impl are what the plugin calls)."""

    #: bucket -> (owner, attribute). ``forward`` contains ``plan`` and ``attention``;
    #: ``build`` contains ``step parts`` (the plugin's batch building from vLLM's tensors).
    BUCKETS: ClassVar[dict[str, tuple[str, str]]] = {
        "build": ("AttnDispatchCPUBuilder", "build"),
        "step parts": ("metadata", "step_parts"),
        "forward": ("AttnDispatchCPUImpl", "forward"),
        "plan": ("Binding", "prepare"),
        "attention": ("backend", "attention"),
        "kv write": ("AttnDispatchCPUImpl", "do_kv_cache_update"),
    }

    def __init__(self) -> None:
        from attn_dispatch._binding import Binding
        from attn_dispatch.integrations.vllm import _metadata
        from attn_dispatch.integrations.vllm import backend

        owners = {
            "AttnDispatchCPUBuilder": backend.AttnDispatchCPUBuilder,
            "AttnDispatchCPUImpl": backend.AttnDispatchCPUImpl,
            "Binding": Binding,
            "backend": backend,
            "metadata": _metadata,  # DispatchMetadata.parts_for calls its step_parts
        }
        self.seconds = dict.fromkeys(self.BUCKETS, 0.0)
        self.calls = dict.fromkeys(self.BUCKETS, 0)
        for bucket, (owner, attr) in self.BUCKETS.items():
            obj = owners[owner]
            setattr(obj, attr, self._timed(bucket, getattr(obj, attr)))

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k], self.calls[k] = 0.0, 0

    def _timed(self, bucket: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - t0
                self.calls[bucket] += 1

        return timed


class PhaseClock:
    """Where a generate's wall time goes, per engine step (``--phases``): each call of the
    engine core's ``step`` is timed whole, and inside it the model runner's
    ``execute_model`` (inputs, metadata build, the model's forward) and ``sample_tokens``,
    and the attention layers' KV writes and forwards. The first step that runs the model is
    the prefill step (every prompt fits in one), the others decode; ``other`` is the
    generate's wall time outside the engine's steps (request set-up and output handling)."""

    PARTS: ClassVar[tuple[str, ...]] = (
        "step",
        "execute",
        "sample",
        "attention",
        "build",
        "forward",
        "gc",
    )

    #: The clock: wall time, or (``--cpu-time``) the calling thread's CPU time, which a burst
    #: of other load on a shared machine does not inflate (meaningful with 1 thread, where
    #: the whole step runs on the calling thread).
    now: ClassVar[Any] = time.perf_counter

    def __init__(self) -> None:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUBuilder
        from attn_dispatch.integrations.vllm.backend import AttnDispatchCPUImpl

        self.steps: list[dict[str, float]] = []
        self._open: dict[str, float] | None = None
        self._wrap(EngineCore, "step", "step", outer=True)
        self._wrap(GPUModelRunner, "execute_model", "execute")
        self._wrap(GPUModelRunner, "sample_tokens", "sample")
        for name in ("forward", "do_kv_cache_update"):
            self._wrap(AttnDispatchCPUImpl, name, "attention")
        self._wrap(AttnDispatchCPUBuilder, "build", "build")
        self._wrap(GPUModelRunner, "_model_forward", "forward")
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = PhaseClock.now()
        elif self._open is not None:
            self._open["gc"] += PhaseClock.now() - self._gc_t0

    def reset(self) -> None:
        self.steps = []

    def _wrap(self, owner: type, attr: str, part: str, outer: bool = False) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if outer:
                self._open = dict.fromkeys(self.PARTS, 0.0)
            t0 = PhaseClock.now()
            try:
                return fn(*args, **kwargs)
            finally:
                row = self._open
                if row is not None:
                    row[part] += PhaseClock.now() - t0
                if outer and row is not None:
                    if row["execute"] > 0.0:  # a step that ran the model
                        self.steps.append(row)
                    self._open = None

        setattr(owner, attr, timed)


def prompts_for(batch: int, prompt: int) -> list[Any]:
    """``batch`` prompts of ``prompt`` tokens (vLLM's TokensPrompt shape), the same for all."""
    return [
        {"prompt_token_ids": [(31 * i + 7 * j) % 2000 + 1 for j in range(prompt)]}
        for i in range(batch)
    ]


def warm_engine(
    model: str, extra: dict[str, Any], prompts: list[Any], dtype: str = "bfloat16"
) -> Any:
    """An eager engine for ``model`` (``extra``: its attention and speculative settings),
    warmed up.

    Before the timed generate each engine runs the same prompts for 4 tokens: the first run
    of each batch shape builds vLLM's oneDNN matmul kernels; prefix caching is off, so the
    timed run computes every prompt again.
    """
    import vllm

    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    llm = vllm.LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        # Room for the prompt, the new tokens and the proposals of a speculative step.
        max_model_len=max(512, longest + 256),
        seed=0,
        enable_prefix_caching=False,
        **extra,
    )
    warm = vllm.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    return llm


def breakdown(model: str, rounds: int, shape: str, args: Any) -> None:
    """Per-step figures: vLLM's own attention against the plugin's ``native``, same run."""
    import torch
    import vllm

    from attn_dispatch._table import format_table
    from attn_dispatch.integrations.vllm import register

    register()
    clock = _once(StepClock)
    batch, prompt, new = lengths(shape)
    prompts = prompts_for(batch, prompt)
    params = vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    contenders: dict[str, dict[str, Any]] = {
        "vllm": {},
        "native": {"additional_config": {"attn_dispatch": {"target": "native"}}},
        "prefill=sdpa,decode=native": {
            "additional_config": {"attn_dispatch": {"target": "prefill=sdpa,decode=native"}}
        },
    }
    best: dict[str, dict[str, float]] = {}
    load_before = load_text()
    for _ in range(rounds):
        for name, extra in contenders.items():
            llm = warm_engine(model, extra, prompts)
            clock.reset()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            steps = max(clock.calls["build"], 1)  # one metadata build per step (one KV group)
            row = {"step": wall / steps, "steps": steps}
            row.update({k: v / steps for k, v in clock.seconds.items()})
            if name not in best or row["step"] < best[name]["step"]:
                best[name] = row
            del llm
            gc.collect()
    ms = 1e3
    rows = []
    for name, r in best.items():
        inner = r["plan"] + r["attention"]
        rows.append(
            [
                name,
                f"{r['steps']:.0f}",
                f"{r['step'] * ms:.2f}",
                f"{r['build'] * ms:.3f}",
                f"{r['step parts'] * ms:.3f}" if name != "vllm" else "-",
                f"{r['kv write'] * ms:.3f}",
                f"{r['forward'] * ms:.3f}",
                f"{r['plan'] * ms:.3f}" if name != "vllm" else "-",
                f"{r['attention'] * ms:.3f}" if name != "vllm" else "-",
                f"{(r['forward'] - inner) * ms:.3f}" if name != "vllm" else "-",
            ]
        )
    print()
    print(
        f"model {shape_text(shape, args.layers)}; native ISA {isa_names()[1]}; load "
        f"{load_before} | {load_text()}; per step, ms (mean over the timed generate; best of "
        f"{rounds}); torch threads "
        f"{torch.get_num_threads()}; forward = every layer's attention call, of which plan "
        "(Binding.prepare, once per step and binding), attention (the kernel call through the "
        "scope) and the rest (scope, slicing, copies)"
    )
    print(
        format_table(
            [
                "attention",
                "steps",
                "step",
                "build",
                "step parts",
                "kv write",
                "forward",
                "plan",
                "attention()",
                "forward rest",
            ],
            rows,
        )
    )
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"vllm_cpu_breakdown_{shape}.json").write_text(json.dumps(best, indent=2))


def phases(model: str, rounds: int, shape: str, args: Any) -> None:
    """Per-phase wall time of the timed generate (``PhaseClock``): the prefill step, the
    decode steps, and the rest, vLLM's own attention against ``native``, same run."""
    import torch
    import vllm

    from attn_dispatch._table import format_table
    from attn_dispatch.integrations.vllm import register

    register()
    if args.cpu_time:
        PhaseClock.now = time.thread_time
    clock = _once(PhaseClock)
    batch, prompt, new = lengths(shape)
    prompts = prompts_for(batch, prompt)
    params = vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    native1 = {"target": "native", "options": {"native": {"num_threads": 1}}}
    contenders = {
        "vllm": {},
        "native": {"additional_config": {"attn_dispatch": {"target": "native"}}},
    }
    if torch.get_num_threads() > 1:
        # Native's kernels on the calling thread alone (the model's ops keep torch's team).
        contenders["native 1t"] = {"additional_config": {"attn_dispatch": native1}}
    best: dict[str, dict[str, float]] = {}
    load_before = load_text()
    for r in range(rounds):
        # Each contender goes first in every other round: the first engine in a round may
        # find the machine in another state (the previous engine's memory, threads).
        order = list(contenders.items())
        for name, extra in order if r % 2 == 0 else order[::-1]:
            llm = warm_engine(model, extra, prompts)
            clock.reset()
            t0 = PhaseClock.now()
            llm.generate(prompts, params, use_tqdm=False)
            wall = PhaseClock.now() - t0
            first, rest = clock.steps[0], clock.steps[1:]
            row = {"generate": wall, "steps": float(len(clock.steps))}
            for part in PhaseClock.PARTS:
                row[f"prefill {part}"] = first[part]
                row[f"decode {part}"] = sum(r[part] for r in rest)
            row["other"] = wall - sum(r["step"] for r in clock.steps)
            # Robust to a burst of other load: the median decode step, times their count.
            mid = sorted(r["step"] for r in rest)[len(rest) // 2]
            row["decode median"] = mid * len(rest)
            print(
                f"round {r + 1}: {name:<9} generate {wall * 1e3:7.2f} ms, prefill step "
                f"{first['step'] * 1e3:6.2f}, decode steps {row['decode step'] * 1e3:7.2f} "
                f"(median x {len(rest)}: {mid * len(rest) * 1e3:7.2f}), other "
                f"{row['other'] * 1e3:5.2f}; load {load_text()}",
                flush=True,
            )
            if name not in best or wall < best[name]["generate"]:
                best[name] = row
            del llm
            gc.collect()
    ms = 1e3
    cols = [
        "generate",
        "prefill step",
        "prefill execute",
        "prefill attention",
        "decode step",
        "decode median",
        "decode execute",
        "decode forward",
        "decode sample",
        "decode attention",
        "decode build",
        "decode gc",
        "prefill gc",
        "other",
    ]
    rows = [
        [name, f"{r['steps']:.0f}", *(f"{r[c] * ms:.2f}" for c in cols)] for name, r in best.items()
    ]
    if "vllm" in best:
        ref = best["vllm"]
        for name in (n for n in contenders if n != "vllm"):
            rows.append(
                [f"{name} - vllm", "", *(f"{(best[name][c] - ref[c]) * ms:+.2f}" for c in cols)]
            )
    print()
    print(
        f"model {shape_text(shape, args.layers)}; native ISA {isa_names()[1]}; load "
        f"{load_before} | {load_text()}; ms "
        f"{'of the calling thread CPU time' if args.cpu_time else 'wall'} per timed generate "
        f"(best of {rounds}); torch "
        f"threads {torch.get_num_threads()}; step = the engine core's step, execute = the "
        "model runner's execute_model, attention = the attention layers' KV writes and "
        "forwards; other = the generate outside the steps"
    )
    print(format_table(["attention", "steps", *cols], rows))
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"vllm_cpu_phases_{shape}.json").write_text(json.dumps(best, indent=2))


def run(
    contenders: dict[str, dict[str, Any]], model: str, rounds: int, shape: str, dtype: str
) -> dict[str, Any]:
    """Every contender's best generate time over ``rounds`` rounds, and its time in each
    round (``per_round``, for the paired ratios: a contender and its reference timed moments
    apart in the same round). The contenders' order is reversed every other round, so that
    neither side always runs first after an engine's start-up. A contender's ``extra`` is its
    ``vllm.LLM`` arguments; a ``speculative_config`` whose ``model`` is a callable gets the
    draft's path from it (made once, beside the target)."""
    import vllm

    from attn_dispatch.integrations.vllm import register

    register()  # what the entry point does; here even without an installed package
    clock = _once(AttentionClock)

    batch, prompt, new = lengths(shape)
    prompts = prompts_for(batch, prompt)
    params = vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    best: dict[str, float] = {}
    attn: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    errors: dict[str, str] = {}
    per_round: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders.items())
        for name, extra in order if r % 2 == 0 else order[::-1]:
            if name in errors:
                continue
            try:
                llm = warm_engine(model, extra, prompts, dtype)
            except Exception as exc:  # reported in the table (e.g. a method vLLM cannot build)
                if "speculative_config" not in extra:
                    raise
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"round {r + 1}: {shape} {name}: {errors[name]}", flush=True)
                gc.collect()
                continue
            clock.seconds = 0.0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            attn[name] = min(attn.get(name, clock.seconds), clock.seconds)
            got = [list(o.outputs[0].token_ids) for o in outs]
            assert all(len(t) == new for t in got), name
            tokens.setdefault(name, got)
            best[name] = min(best.get(name, dt), dt)
            per_round[name].append(dt)
            print(
                f"round {r + 1}: {shape} {name:<28} {batch * new / dt:8.1f} tokens/s, "
                f"attention {clock.seconds:.2f} s of {dt:.2f} s",
                flush=True,
            )
            del llm
            gc.collect()
    return {
        "seconds": best,
        "per_round": per_round,
        "attention": attn,
        "tokens": tokens,
        "errors": errors,
    }


def paired_ratios(ref: list[float], mine: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) over the rounds of the reference's time / the contender's
    time in the same round (> 1: the contender is faster). Best-of figures compare each
    side's luckiest round; on a shared machine whose speed drifts between rounds, the
    paired ratio is the steadier figure."""
    ratios = sorted(a / b for a, b in zip(ref, mine, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def reference(name: str) -> str:
    """The row a contender is measured against: vLLM's own attention in the same set-up
    (``"native, eagle"`` -> ``"vllm, eagle"``; no suffix -> ``"vllm"``)."""
    _, sep, setup = name.partition(", ")
    return f"vllm{sep}{setup}"


def contenders_for(args: Any, root: Path, shape: str) -> dict[str, dict[str, Any]]:
    """The engines of one shape's table (``extra``: their ``vllm.LLM`` arguments)."""
    ad = "additional_config"

    def spec(target: str, draft: str | None = None) -> dict[str, Any]:
        settings = {"target": target} if draft is None else {"target": target, "draft": draft}
        return {ad: {"attn_dispatch": settings}}

    out: dict[str, dict[str, Any]] = {
        "vllm": {},
        "native": spec("native"),
        "prefill=sdpa,decode=native": spec("prefill=sdpa,decode=native"),
    }
    if args.mixed:
        mixed = {"max_num_batched_tokens": 256}
        out.update(
            {
                "vllm, mixed": dict(mixed),
                "native split, mixed": {**mixed, **spec("native")},
                "native extend, mixed": {
                    **mixed,
                    ad: {"attn_dispatch": {"target": "native", "mixed": "extend"}},
                },
            }
        )
    if args.spec:
        # draft_model: a 1-layer Llama of the target's shape (its own weights); EAGLE: a
        # one-layer head over the target's hidden states. Target and draft on native.
        draft = make_model(root, 1, shape, name="draft")
        methods = {"draft_model": draft}
        if args.eagle:
            methods["eagle"] = make_eagle_head(root, shape)
        for method, path in methods.items():
            sc = {
                "speculative_config": {
                    "method": method,
                    "model": path,
                    "num_speculative_tokens": SPEC_TOKENS,
                }
            }
            out[f"vllm, {method}"] = dict(sc)
            out[f"native, {method}"] = {**sc, **spec("native", "native")}
    return out


# The speed-up over vLLM's own engine the long-context rows aim at (issue 47).
GOAL = 1.3


def attention_bounds(
    ref_s: float, ref_attn: float, own_s: float, own_attn: float
) -> tuple[float, str, float]:
    """What attention alone can give a row (Amdahl, from the row's own measured time outside
    attention): its ``x vllm`` if its attention took no time at all, how many times faster
    than vLLM's own attention (``ref_attn``) it must be for ``GOAL`` x vLLM's tokens/s
    ("unreachable" where the rest alone is already slower than that), and the attention
    seconds that allows (<= 0 when unreachable)."""
    rest = own_s - own_attn
    ceiling = ref_s / rest if rest > 0 else float("inf")
    allowed = ref_s / GOAL - rest
    needed = f"{ref_attn / allowed:.1f}" if allowed > 0 else "unreachable"
    return ceiling, needed, allowed


def prefill_macs(shape: str, layers: int) -> int:
    """Multiply-adds of the causal prefill of ``shape``'s prompts in ``layers`` attention
    layers: each of a prompt's L tokens attends to itself and the tokens before it (L(L+1)/2
    pairs), q.K^T and p.V over every query head's head size."""
    _, _, qh, _, hd = SHAPES[shape]
    batch, prompt, _ = lengths(shape)
    return batch * prompt * (prompt + 1) // 2 * qh * hd * 2 * layers


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    """Tokens equal to the reference's, counted up to each request's first difference (bf16
    sums in another order can flip a near-tie, and greedy decoding diverges from there)."""
    agree = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        agree += n
    total = sum(len(x) for x in a)
    return "all" if agree == total else f"{agree}/{total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--model",
        choices=[*SHAPES, "both"],
        default="both",
        help="model shape: bench (hidden 1024, GQA 16/4 x 64), tiny (hidden 256, GQA 4/2 x 64), "
        "long (hidden 1024, GQA 8/2 x 128, 4 x 2048-token prompts + 64 new), or both (bench "
        "and tiny)",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="add the mixed-step rows (max_num_batched_tokens=256: chunked prefill + decode)",
    )
    parser.add_argument(
        "--spec",
        action="store_true",
        help=f"add the speculative rows ({SPEC_TOKENS} tokens): draft_model with a 1-layer "
        "draft and an EAGLE head, each with vLLM's own attention and with native for both",
    )
    parser.add_argument(
        "--no-eagle", dest="eagle", action="store_false", help="--spec without the EAGLE rows"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the engines' dtype (float32: tokens comparable exactly)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 layer, tiny model, nothing written"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="per-step figures (batch building, planning, kernel calls) instead of tokens/s",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="per-phase wall time of the generate (prefill step, decode steps, the rest), "
        "vLLM's own attention against native",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="--phases in the calling thread's CPU time (with OMP_NUM_THREADS=1: the whole "
        "step's work, whatever the other load on the machine)",
    )
    args = parser.parse_args()
    global BATCH, PROMPT, NEW
    if args.quick:  # checks the script runs; the figures are not comparable
        args.rounds, args.layers, args.model = 1, 1, "tiny"
        BATCH, PROMPT, NEW = 2, 16, 4
    import torch

    shapes = ["bench", "tiny"] if args.model == "both" else [args.model]
    if args.phases:
        for shape in shapes:
            with tempfile.TemporaryDirectory() as tmp:
                phases(make_model(Path(tmp), args.layers, shape), args.rounds, shape, args)
        return
    if args.breakdown:
        for shape in shapes:
            with tempfile.TemporaryDirectory() as tmp:
                breakdown(make_model(Path(tmp), args.layers, shape), args.rounds, shape, args)
        return

    from attn_dispatch._table import format_table

    vllm_isa, native_isa = isa_names()
    rows = []
    # Per row: (shape, attention layers it runs): the target's, and a speculative row's
    # one-layer draft (both methods), for the prefill floor below.
    row_layers: list[tuple[str, int]] = []
    results: dict[str, Any] = {}
    loads = [load_text()]
    for shape in shapes:
        batch, _, new = lengths(shape)
        with tempfile.TemporaryDirectory() as tmp:
            model = make_model(Path(tmp), args.layers, shape)
            contenders = contenders_for(args, Path(tmp), shape)
            res = run(contenders, model, args.rounds, shape, args.dtype)
        loads.append(load_text())
        results[shape] = res
        secs, attn, toks = res["seconds"], res["attention"], res["tokens"]
        for name in contenders:
            row_layers.append(
                (shape, args.layers + (1 if "speculative_config" in contenders[name] else 0))
            )
            ref = reference(name)
            isa = vllm_isa if name.startswith("vllm") else native_isa
            failed = res["errors"].get(name) or res["errors"].get(ref)
            if failed:
                rows.append(
                    [shape, name, isa, "failed", "-", "-", "-", "-", "-", "-", "-", failed[:160]]
                )
                continue
            ceiling, needed, allowed = attention_bounds(
                secs[ref], attn[ref], secs[name], attn[name]
            )
            mid, low, high = paired_ratios(res["per_round"][ref], res["per_round"][name])
            rows.append(
                [
                    shape,
                    name,
                    isa,
                    f"{batch * new / secs[name]:.1f}",
                    f"{secs[ref] / secs[name]:.2f}",
                    f"{mid:.2f} ({low:.2f}-{high:.2f})",
                    f"{attn[name]:.2f}",
                    f"{attn[ref] / attn[name]:.2f}",
                    f"{ceiling:.2f}",
                    needed,
                    f"{allowed:.2f}" if allowed > 0 else "-",
                    _same(toks[name], toks[ref]),
                ]
            )
    # The compute roof of the floor column, measured after the engines (they are gone).
    if not args.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kernels_cpu import gemm_peak

        peak, peak_dtype = gemm_peak(7)
        peak_text = f"; GEMM peak {peak / 1e9:.0f} GMAC/s ({peak_dtype})"
    else:
        peak, peak_text = math.nan, ""
    for row, (shape, layers) in zip(rows, row_layers, strict=True):
        row.insert(-1, f"{prefill_macs(shape, layers) / peak:.2f}" if not math.isnan(peak) else "-")
    print()
    print(
        f"vLLM {__import__('vllm').__version__} CPU engine, {args.dtype} Llama "
        f"({'; '.join(shape_text(s, args.layers) for s in shapes)}), greedy"
        + (f", speculative rows {SPEC_TOKENS} tokens" if args.spec else "")
        + f"; torch threads {torch.get_num_threads()}; best of {args.rounds} rounds (per round: "
        "the median and range over the rounds of the two engines' ratio in one round); native "
        f"ISA {native_isa}, vLLM's {vllm_isa}{peak_text}; load (1/5/15 min) before and after "
        "each model: " + " | ".join(loads)
    )
    print(
        format_table(
            [
                "model",
                "attention",
                "isa",
                "tokens/s",
                "x vllm",
                "x vllm per round",
                "attention s",
                "x vllm (attention)",
                "x vllm, attention free",
                f"attention x for {GOAL}x",
                f"attention s for {GOAL}x",
                "prefill floor s",
                "tokens as vllm's",
            ],
            rows,
        )
    )
    if args.quick:
        return
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    # The default table keeps its file; other selections get their own.
    tag = "".join(
        [
            "" if args.model == "both" else f"_{args.model}",
            "_spec" if args.spec else "",
            "" if args.dtype == "bfloat16" else f"_{args.dtype}",
        ]
    )
    (out / f"vllm_cpu{tag}.json").write_text(
        json.dumps(
            {
                "vllm_isa": vllm_isa,
                "native_isa": native_isa,
                "dtype": args.dtype,
                "load": loads,
                "seconds": {s: r["seconds"] for s, r in results.items()},
                "attention_seconds": {s: r["attention"] for s, r in results.items()},
                "rows": rows,
                "layers": args.layers,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
