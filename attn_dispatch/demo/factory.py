"""Building the demo's runners: sizes, dtype, default backends, bindings."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import bind
from attn_dispatch.backend import list_backends
from attn_dispatch.demo.shapes import DraftShape
from attn_dispatch.demo.shapes import TargetShape
from attn_dispatch.demo.values import DemoOptions

if TYPE_CHECKING:
    from attn_dispatch.demo.legacy import LegacyGlobals
    from attn_dispatch.demo.runner import Runner

# Preference order of default backends (the first that binds wins; the draft prefers one the
# target does not use, so the demo shows two runners on two backends).
CPU_TARGET = ("native", "torch")
CPU_DRAFT = ("torch", "native")
CUDA_TARGET = ("flashinfer", "triton", "torch")
CUDA_DRAFT = ("triton", "flashinfer", "torch")


@dataclasses.dataclass(frozen=True, slots=True)
class Size:
    """A model size and the run settings that suit it."""

    target: TargetShape
    draft: DraftShape
    max_new_tokens: int
    depth: int
    branch: int
    help: str


def sizes() -> dict[str, Size]:
    return {
        # Weight-bound like a real model on a CPU: each forward reads ~130M weights, a decode
        # step of 2 requests costs about what a verify of 2 trees does, so every token the
        # draft gets right is a target forward saved.
        "base": Size(
            TargetShape(
                vocab=8192,
                hidden=1024,
                layers=12,
                heads=8,
                qk_nope=64,
                qk_rope=32,
                kv_lora_rank=256,
                v_head=64,
                mlp=4096,
                head_rank=256,
                out_scale=0.05,
                mlp_scale=0.01,
            ),
            DraftShape(layers=1, heads=4, kv_heads=2, head_dim=32, mlp=256),
            max_new_tokens=128,
            depth=4,
            branch=2,
            help="~130M-weight MLA target, 1-layer draft; speculation wins (default)",
        ),
        # Seconds on two CPU cores; what the tests run.
        "tiny": Size(
            TargetShape(), DraftShape(), max_new_tokens=32, depth=3, branch=2, help="tests"
        ),
        # DeepSeek-V3's attention widths (q/k 576 = latent 512 + rope 64, v 512; draft head
        # 128): the sizes GPU kernels such as FlashInfer's MLA path are built for.
        "wide": Size(
            TargetShape(
                vocab=256,
                hidden=256,
                heads=8,
                qk_nope=128,
                qk_rope=64,
                kv_lora_rank=512,
                v_head=128,
                mlp=512,
            ),
            DraftShape(heads=4, kv_heads=2, head_dim=128, mlp=512),
            max_new_tokens=32,
            depth=3,
            branch=2,
            help="DeepSeek-V3 attention widths 576/512 (GPU kernels' sizes)",
        ),
    }


def choose_dtype(
    size: str, device: str, hidden: int, mlp: int, rows: int, verify_rows: int | None = None
) -> tuple[str, str]:
    """The dtype this machine runs the target fastest in, and why (measured, ~0.1 s).

    On CPUs with AVX512_BF16 or AMX bf16 matmuls are about twice as fast as fp32; on
    AVX2-only CPUs torch's bf16 matmul is a slow fallback. So: time both, at the decode's rows
    and at the verify's (``verify_rows``): a dtype that wins the 2-row decode matmul on memory
    bandwidth can lose the verify's many rows, which would make speculation look slow. The
    pick is the dtype with the smaller sum of one decode and one verify matmul."""
    import torch
    import torch.nn.functional as F

    if device.startswith("cuda"):
        # As before this demo measured CPUs: untested on GPUs in bf16, where the verify and
        # decode kernels may round a near-tie apart (pass --dtype bfloat16 to try).
        return "float32", "cuda: --dtype bfloat16 to try the reduced-precision kernels"
    isa = torch.backends.cpu.get_cpu_capability()
    if size == "tiny":
        return "float32", f"{isa}; tiny models are bound by per-forward overhead, not matmuls"
    sizes = [rows] if verify_rows is None or verify_rows == rows else [rows, verify_rows]
    w = torch.randn(mlp, hidden) / hidden**0.5
    best: dict[str, list[float]] = {}
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        wd = w.to(dt)
        for n in sizes:
            xd = torch.randn(n, hidden).to(dt)
            F.linear(xd, wd)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                F.linear(xd, wd)
                times.append(time.perf_counter() - t0)
            best.setdefault(name, []).append(min(times))
    pick = min(best, key=lambda k: sum(best[k]))
    why = ", ".join(f"{k} {' + '.join(f'{t * 1e3:.2f}' for t in v)} ms" for k, v in best.items())
    shapes = " and ".join(f"[{n}x{hidden}]" for n in sizes)
    return pick, f"{isa}; matmul {shapes} x [{hidden}x{mlp}]: {why}"


def _binds(name: str, config: AttnConfig) -> bool:
    """Whether ``name`` can serve every phase of ``config`` here (a real ``bind``: it also
    checks the MLA form policy, which capabilities alone do not)."""
    if name not in list_backends():
        return False
    try:
        bind(BackendSpec.uniform(name), config)
    except AttnDispatchError:
        return False
    return True


def default_specs(
    target_cfg: AttnConfig,
    draft_cfg: AttnConfig,
    target_spec: BackendSpec | None,
    draft_spec: BackendSpec | None,
) -> tuple[BackendSpec, BackendSpec]:
    """Fill in what the user did not give from what can run here (never override a choice)."""
    cuda = target_cfg.device_type == "cuda"
    if target_spec is None:
        order = CUDA_TARGET if cuda else CPU_TARGET
        name = next((n for n in order if _binds(n, target_cfg)), "torch")
        target_spec = BackendSpec.uniform(name)
    if draft_spec is None:
        order = CUDA_DRAFT if cuda else CPU_DRAFT
        used = set(target_spec.all_names)
        usable = [n for n in order if _binds(n, draft_cfg)]
        fresh = [n for n in usable if n not in used]
        draft_spec = BackendSpec.uniform((fresh or usable or ["torch"])[0])
    return target_spec, draft_spec


def build(
    opts: DemoOptions,
    *,
    device: str,
    dtype: str,
    target_spec: BackendSpec | None,
    draft_spec: BackendSpec | None,
    legacy: LegacyGlobals | None = None,
    target_shape: TargetShape | None = None,
    draft_shape: DraftShape | None = None,
    attn_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> tuple[Runner, Runner]:
    """Seeded models and their runners, each with its own binding and cache.

    ``kv_dtype``: None keeps each cache in its runner's attention dtype; an FP8 format
    (``"float8_e4m3fn"``/``"float8_e5m2"``) stores both runners' caches in it with per-layer
    scales; another dtype is the target's attention and latent cache dtype.

    >>> target, draft = build(DemoOptions(), device="cpu", dtype="float32",
    ...                       target_spec=None, draft_spec=None)
    """
    import torch

    from attn_dispatch.demo.models import build_models
    from attn_dispatch.demo.runner import Runner

    size = sizes()[opts.size]
    fp8 = kv_dtype is not None and kv_dtype.startswith("float8")
    if kv_dtype is not None and not fp8:
        attn_dtype, kv_dtype = kv_dtype, None
    tmodel, dmodel = build_models(
        size.target if target_shape is None else target_shape,
        size.draft if draft_shape is None else draft_shape,
        seed=opts.seed,
        dtype=getattr(torch, dtype),
        device=device,
        attn_dtype=None if attn_dtype is None else getattr(torch, attn_dtype),
        kv_dtype=None if kv_dtype is None else getattr(torch, kv_dtype),
    )
    tcfg = tmodel.attn_config(page_size=opts.page_size, device=device)
    dcfg = dmodel.attn_config(page_size=1, device=device)
    tspec, dspec = default_specs(tcfg, dcfg, target_spec, draft_spec)
    pages = opts.num_pages or pages_needed(opts)
    tbind = bind(tspec, tcfg, label="target")
    dbind = bind(dspec, dcfg, label="draft")
    if legacy is None:
        target = Runner("target", tmodel, tbind, num_pages=pages, spec=tspec)
        draft = Runner("draft", dmodel, dbind, num_pages=pages * opts.page_size, spec=dspec)
    else:
        from attn_dispatch.demo.legacy import LegacyRunner

        # Start-up order as in a server: the target first, then its draft.
        target = LegacyRunner("target", tmodel, tbind, num_pages=pages, globals_=legacy)
        draft = LegacyRunner(
            "draft", dmodel, dbind, num_pages=pages * opts.page_size, globals_=legacy
        )
    return target, draft


def pages_needed(opts: DemoOptions) -> int:
    """Target pages for every request at its longest: prompt, output and one draft tree (its
    own copy of a shared prefix included: what the layout without sharing needs)."""
    longest = max(prompt_lengths(opts)) + opts.max_new_tokens + 1 + opts.branch * opts.depth
    return opts.batch * -(-longest // opts.page_size) + 1


def prompt_lengths(opts: DemoOptions) -> list[int]:
    # Different lengths: ragged page tables.
    return [opts.shared_prefix + 5 + 4 * i for i in range(opts.batch)]


def prompts_for(opts: DemoOptions, vocab: int) -> list[list[int]]:
    """Seeded prompts: the shared system prompt (``opts.shared_prefix`` tokens), then each
    request's own tokens."""
    import torch

    gen = torch.Generator().manual_seed(opts.seed + 1)
    system = torch.randint(0, vocab, (opts.shared_prefix,), generator=gen).tolist()
    own = [n - opts.shared_prefix for n in prompt_lengths(opts)]
    return [system + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in own]


def describe(target: Any, draft: Any) -> list[str]:
    """The runners in words (shape, size, cache)."""
    ts, ds = target.model.shape, draft.model.shape
    tc, dc = target.attn_binding.config, draft.attn_binding.config
    return [
        f"  target  DeepSeek-style MLA, {ts.params / 1e6:.1f}M weights per forward: "
        f"{ts.layers} layers, hidden {ts.hidden}, {ts.heads} heads, q/k {tc.head_dim} = "
        f"latent {ts.kv_lora_rank} + rope {ts.qk_rope}, v {tc.v_head_dim}, paged latent cache "
        f"[pages, {tc.page_size}, {tc.head_dim}] (decompressed form "
        f"{tc.mha_head_dim}/{tc.mha_v_head_dim} where the backend's form policy picks it)",
        f"  draft   GQA MHA, {draft.model.params / 1e6:.2f}M weights per forward: "
        f"{ds.layers} layer{'s' if ds.layers > 1 else ''}, width {draft.model.width} (the "
        f"directions the target's LM head reads; embedding and head derived from the "
        f"target's), {ds.heads} q / {ds.kv_heads} kv heads, head {dc.head_dim}, paged K/V "
        f"[pages, {dc.page_size}, {ds.kv_heads}, {ds.head_dim}]",
    ]
