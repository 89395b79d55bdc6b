"""Triton backend, light half: capabilities only (imports no torch and no triton).

The kernels (``_decode``, ``_extend``) and ``backend.TritonBackend`` load at bind time.
On CUDA the kernels compile for the GPU. On CPU they run only under triton's interpreter,
which must be switched on with ``TRITON_INTERPRET=1`` in the environment *before* the backend
is first bound (triton reads it when the kernels are defined); tests set it at import.

Head widths: q/k width ``D`` is split into the largest power of two <= D plus the rest padded
to a power of two >= 16 (576 = 512 + 64, 80 = 64 + 16, 96 = 64 + 32); v is padded to a power
of two >= 16. Widths 16..1024 are served; see ``_dims``.

Layer variants, every phase, MHA/GQA and MLA: ``window_left`` (pages before a request's window
are never read: decode starts its split range at the window, extend starts each query block at
its first row's window), ``logit_cap`` (cap * tanh on the scaled scores) and ``sinks`` (one
logit per q head in the softmax denominator). FP8 caches (``float8_e4m3fn`` / ``float8_e5m2``,
with ``dtype`` fp32/fp16/bf16): the kernels widen K/V in registers to q's dtype (exact), fold
``k_scale`` into the score scale and apply ``v_scale`` to the output; e4m3fn needs sm89+ on CUDA.
Under the CPU interpreter FP8 loads convert exactly for every finite value; its NaN/Inf bit
patterns, which the interpreter decodes as large finite numbers, are put back from the bits
(``_tile._widen``; compiled GPU kernels follow the formats). Attention types, every phase:
``causal=False`` (extend walks every key of the request) and ``attention_chunk_size`` (decode
starts at the query's chunk, extend skips keys before each query block's chunk).

Attention state (variant ``"lse"``): the handlers take ``return_lse=True`` and return
``(out, lse)``, lse float32 [tokens, q_heads], the natural log of the sum of exp(score) over
the keys a row attended plus exp(sink): the extend kernel and the decode merge kernel write it
from the state they normalise the output with (log2 units inside, converted on store).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attn_dispatch._env import TRITON_INTERPRET
from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backend import Phase
from attn_dispatch.backends.triton._dims import dim_reasons

if TYPE_CHECKING:
    from attn_dispatch.backend import AttnConfig


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` asks triton for its CPU interpreter."""
    return os.environ.get(TRITON_INTERPRET, "").strip().lower() in {"1", "true", "yes", "on"}


def _runnable_here() -> Iterable[str]:
    if interpreter_on():
        yield from _interpreter_reasons()
        return
    try:
        import torch  # at call time only: this module stays torch-free at import

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    if not cuda:
        yield (
            "needs a CUDA device, or TRITON_INTERPRET=1 to run the kernels on CPU under "
            "triton's interpreter (for tests; set it before the backend is first bound)"
        )


def _interpreter_reasons() -> Iterable[str]:
    # triton decides per @jit function, when it is defined, whether it is interpreted: if
    # triton.language was imported before TRITON_INTERPRET=1 was set (torch.compile's
    # inductor imports it, for one), its own helpers (tl.cdiv, tl.zeros, ...) stay compiled
    # and the interpreter refuses to call them from our kernels. Only inspects what is loaded.
    lang = sys.modules.get("triton.language")
    helper = getattr(lang, "cdiv", None)
    if helper is not None and type(helper).__name__ == "JITFunction":
        yield (
            "TRITON_INTERPRET=1 was set after triton.language had been imported (for example "
            "by torch.compile), so triton's own helpers run compiled and the interpreter "
            "cannot call them; set TRITON_INTERPRET=1 at process start, before anything "
            "imports triton"
        )


def _device_check(config: AttnConfig, phase: Phase) -> Iterable[str]:
    # Off CUDA machines the availability reason already says this; say it once.
    if config.device_type == "cpu" and not interpreter_on() and not list(_runnable_here()):
        yield (
            f"device {config.device!r} needs TRITON_INTERPRET=1: on CPU the triton kernels run "
            "only under triton's interpreter (for tests); set it in the environment before the "
            "backend is first bound, or use a CUDA device"
        )


def _shape_check(config: AttnConfig, phase: Phase) -> Iterable[str]:
    assert config.v_head_dim is not None
    yield from dim_reasons(config.head_dim, config.v_head_dim)
    if config.kv_dtype != config.dtype and config.kv_dtype not in FP8_KV_DTYPES:
        yield (
            f"kv_dtype {config.kv_dtype!r} differs from dtype {config.dtype!r}: the triton "
            "kernels take a cache in the compute dtype, or an FP8 cache "
            f"({', '.join(FP8_KV_DTYPES)}) that they widen to it"
        )


def _fp8_check(config: AttnConfig, phase: Phase) -> Iterable[str]:
    # triton lowers float8_e4m3fn (its fp8e4nv) only for sm89+; e5m2 converts on sm80 too.
    if config.kv_dtype != "float8_e4m3fn" or config.device_type != "cuda":
        return
    cc, why = _capability(config.device)
    if cc is None:
        # Never accept what was not inspected: a device this process cannot see may be
        # older than sm89.
        yield (
            f"kv_dtype 'float8_e4m3fn' needs sm89+ in triton (fp8e4nv), and the compute "
            f"capability of {config.device!r} could not be read ({why}); bind where that "
            "device is visible, or use 'float8_e5m2' or a 16-bit cache"
        )
    elif cc < (8, 9):
        yield (
            f"kv_dtype 'float8_e4m3fn' needs sm89+ in triton (fp8e4nv); {config.device!r} is "
            f"sm{cc[0]}{cc[1]}: use 'float8_e5m2' or a 16-bit cache"
        )


def _capability(device: str) -> tuple[tuple[int, int] | None, str]:
    """``(compute capability, "")`` of the CUDA ``device``, or ``(None, why not)``."""
    try:
        import torch
    except ImportError:
        return None, "torch is not importable"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible to this process"
    try:
        major, minor = torch.cuda.get_device_capability(torch.device(device))
    except (RuntimeError, ValueError, AssertionError, TypeError) as exc:  # a bad index, say
        return None, f"{type(exc).__name__}: {exc}"
    return (int(major), int(minor)), ""


#: FP8 cache formats the kernels widen in registers (K / k_scale and V / v_scale stored).
FP8_KV_DTYPES = tuple(sorted(FP8_DTYPES))

#: The form policy of MLA configs (registered with the backend; a ``form_policy`` option
#: given to ``bind`` overrides it).
DEFAULT_FORM_POLICY = FormPolicy.decompressed_without_prefix()

CAPABILITIES = Capabilities(
    kinds=frozenset({"mha", "mla"}),
    phases=frozenset(Phase),
    devices=frozenset({"cuda", "cpu"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    kv_dtypes=frozenset({"float32", "float16", "bfloat16", *FP8_KV_DTYPES}),
    # Every variant in every phase, MHA/GQA and MLA (kernels: _decode, _extend); "lse": every
    # handler takes return_lse=True and returns (out, lse).
    variants=frozenset({"window", "logit_cap", "sinks", "non_causal", "chunked", "lse"}),
    custom_mask=True,
    # Every handler writes a caller's out= buffer through its row strides.
    out_buffer=True,
    # MLA: absorbed over the paged latent cache in every phase; prefill may also run the
    # decompressed MHA form (ragged K/V through a second instance of this backend). No
    # chunked-prefix entry point ('mha_chunked').
    forms={Phase.PREFILL: {"mla", "mha"}, Phase.DECODE: {"mla"}, Phase.VERIFY: {"mla"}},
    requires=("torch", "triton"),
    # bf16 tl.dot needs Ampere; older GPUs are not served rather than served in part.
    min_compute_capability=(8, 0),
    checks=(_device_check, _shape_check, _fp8_check),
    availability=(_runnable_here,),
    description=(
        "Triton kernels: split-KV paged decode, prefix + causal/tree-mask extend, MHA/GQA and "
        "absorbed MLA, sliding window / soft cap / sinks, FP8 caches; CUDA, or CPU under "
        "TRITON_INTERPRET=1"
    ),
)

__all__ = ["CAPABILITIES", "DEFAULT_FORM_POLICY", "FP8_KV_DTYPES", "interpreter_on"]
