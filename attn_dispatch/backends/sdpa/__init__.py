"""The ``sdpa`` backend, light half: capabilities only (imports no torch).

PyTorch's fused ``scaled_dot_product_attention`` over the paged-KV contract; the kernels are
driven from ``backend.py``, imported at bind. On CPU every call goes to the fused flash op
``aten._scaled_dot_product_flash_attention_for_cpu`` (what the public function runs there),
which also returns the natural-log LSE the backend needs to merge parts and apply sinks. On
CUDA the public function picks FlashAttention / cuDNN / memory-efficient kernels; calls that
need the LSE use the memory-efficient op, which returns it.

Served: MHA/GQA and MLA (the absorbed form over the latent cache, and the decompressed forms
``mha`` and ``mha_chunked``), every phase (tree verify through a mask), ``window_left``,
``attention_chunk_size``, ``causal=False``, sinks (applied through the LSE), FP8 caches
(dequantised as the pages are gathered), ``return_lse``. Head sizes: q/k and v are padded to
one width where they differ (the CPU flash op takes one head size). Refused at bind, with the
reason: ``logit_cap`` (no fused PyTorch kernel applies a soft-cap to the scores; serving it
would mean materialising every score, which this backend does not do silently).
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attn_dispatch.backend import COMPUTE_DTYPES
from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy

if TYPE_CHECKING:
    from attn_dispatch.backend import AttnConfig
    from attn_dispatch.backend import Phase

#: torch 2.5 added ``enable_gqa`` to the public function; the CPU flash op returns the LSE
#: from 2.3. Older torch is refused by the availability check.
MIN_TORCH = (2, 5)


def _torch_version() -> tuple[int, int] | None:
    try:
        text = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _availability() -> Iterable[str]:
    version = _torch_version()
    if version is not None and version < MIN_TORCH:
        yield (
            f"needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (scaled_dot_product_attention with "
            f"enable_gqa), found {version[0]}.{version[1]}"
        )


def _check_cap(config: AttnConfig, phase: Phase) -> Iterable[str]:
    if config.logit_cap:
        yield (
            f"logit_cap={config.logit_cap!r}: PyTorch's fused attention kernels apply no "
            "soft-cap to the scores, and emulating it would materialise every score; bind "
            "'native', 'triton' or 'torch' for this layer group"
        )


#: Decompressed MLA for prefill (one shot up to 2048 cached prefix tokens in the batch,
#: chunked beyond), the absorbed form for decode and verify (as the reference backend).
DEFAULT_FORM_POLICY = FormPolicy()

CAPABILITIES = Capabilities(
    kinds={"mha", "mla"},
    devices={"cpu", "cuda"},
    dtypes={"float32", "float16", "bfloat16"},
    kv_dtypes={*COMPUTE_DTYPES, *FP8_DTYPES},
    custom_mask=True,
    out_buffer=True,
    variants={"window", "sinks", "non_causal", "chunked", "lse"},
    requires=("torch",),
    checks=(_check_cap,),
    availability=(_availability,),
    forms={"mla", "mha", "mha_chunked"},
    description=(
        "PyTorch's fused scaled_dot_product_attention over gathered pages (CPU flash op with "
        "its LSE; FlashAttention/cuDNN/mem-efficient on CUDA): prefix and new tokens as two "
        "parts merged by LSE, window/chunk/tree masks, sinks through the LSE, FP8 dequantised "
        "on gather; no logit cap"
    ),
)
