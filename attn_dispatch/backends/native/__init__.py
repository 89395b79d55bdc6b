"""The ``native`` backend: C++ CPU kernels from ``csrc/`` (capabilities only; the kernels are
driven from ``backend.py``).

Head dims: any ``head_dim`` and ``v_head_dim`` from 1 to 2048 (rows are zero-padded to the
vector width in registers, so no multiple is required; the bound sizes the per-thread
buffers). Dtypes: q float32, bfloat16 or float16 with a cache of any of the three; the
output has q's dtype; accumulation is fp32 (16-bit values are widened in registers). FP8
caches (``float8_e4m3fn``, ``float8_e5m2``) with per-call ``k_scale``/``v_scale``, MHA/GQA and
MLA, every phase, converted to fp32 in registers. Layer variants ``window``, ``logit_cap`` and
``sinks`` in every phase (a window skips the pages wholly outside it; on a tree-verify mask it
keeps the ``window_left + 1`` most recent keys each query's mask allows). Attention types
``non_causal`` (``causal=False``) and ``chunked`` (``attention_chunk_size``; pages before a
query block's chunk are skipped) in every phase. Any page size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from attn_dispatch.backend import COMPUTE_DTYPES
from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backends.native._lib import unavailable_reason

if TYPE_CHECKING:
    from attn_dispatch.backend import AttnConfig
    from attn_dispatch.backend import Phase

MAX_HEAD_DIM = 2048  # csrc/kernels.h kMaxHeadDim


def _check_dims(config: AttnConfig, phase: Phase) -> Iterable[str]:
    for field in ("head_dim", "v_head_dim"):
        value = getattr(config, field)
        if not 1 <= value <= MAX_HEAD_DIM:
            yield (
                f"{field} {value!r} is outside the native kernels' range [1, {MAX_HEAD_DIM}] "
                "(per-thread buffers are sized from it)"
            )


def _availability() -> Iterable[str]:
    reason = unavailable_reason()
    return [] if reason is None else [reason]


#: The form policy of MLA configs unless the ``form_policy`` option says otherwise.
DEFAULT_FORM_POLICY = FormPolicy.decompressed_without_prefix()

CAPABILITIES = Capabilities(
    kinds={"mha", "mla"},
    devices={"cpu"},
    dtypes={"float32", "bfloat16", "float16"},
    kv_dtypes={*COMPUTE_DTYPES, *FP8_DTYPES},
    custom_mask=True,
    out_buffer=True,
    requires=("torch",),
    checks=(_check_dims,),
    availability=(_availability,),
    forms={"prefill": {"mla", "mha"}, "decode": {"mla"}, "verify": {"mla"}},
    variants={"window", "logit_cap", "sinks", "non_causal", "chunked", "lse"},
    description=(
        "C++ CPU kernels (csrc/): paged decode and prefix+causal/custom-mask extend, split-KV, "
        "bf16/fp16/FP8 caches converted in registers, sliding window, logit cap, sinks, "
        "AVX2/AVX-512/AVX-512-BF16 chosen at run time"
    ),
)
