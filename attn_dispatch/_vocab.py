"""The vocabularies every layer speaks, defined once: kinds, verify modes, layer variants,
attention forms and dtype names (compute and KV cache, FP8 included). No torch.

Config checks (``AttnConfig``), declarations (``Capabilities``), the registry, the backends and
the integrations import these names; a new kind, variant, form or FP8 format is added here.

>>> "float8_e5m2" in FP8_DTYPES and "window" in VARIANTS
True
"""

from __future__ import annotations

import enum
from typing import Literal

#: What the layers of one runner are: multi-head (GQA included) or DeepSeek's latent MLA.
Kind = Literal["mha", "mla"]
KINDS: tuple[Kind, ...] = ("mha", "mla")

#: Which backend serves VERIFY when ``BackendSpec.verify`` is None (SGLang's
#: ``speculative_attention_mode``).
VerifyMode = Literal["prefill", "decode"]
VERIFY_MODES: tuple[VerifyMode, ...] = ("prefill", "decode")

#: The layer variants a config uses and a backend declares (``Capabilities.variants``).
#: ``"lse"`` is the attention state as an output (``AttnConfig(return_lse=True)``): a backend
#: declaring it returns ``(out, lse)`` when a call asks (``attention(..., return_lse=True)``).
VARIANTS = ("window", "logit_cap", "sinks", "non_causal", "chunked", "lse")

#: Compute dtypes (``AttnConfig.dtype``), and the FP8 formats a KV cache may hold besides them.
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
#: Accepted spellings -> the canonical dtype name (torch's attribute name).
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}
DTYPE_NAMES = frozenset(DTYPE_ALIASES.values())


class AttnForm(str, enum.Enum):
    """How an MLA layer computes attention for one batch.

    ``MLA``: absorbed form over the paged latent cache (q/k = latent + rope, v = latent).
    ``MHA``: decompressed, one shot: the caller up-projects the whole sequence (cached prefix
    and new tokens) into ragged per-head K/V and calls ``attention(q, k, v, ...)``.
    ``MHA_CHUNKED``: decompressed, the cached prefix up-projected chunk by chunk (bounded
    memory for long prefixes): ``attention(q, k_new, v_new, ..., prefix=chunks)``.
    """

    MLA = "mla"
    MHA = "mha"
    MHA_CHUNKED = "mha_chunked"


#: The form names ``Capabilities.forms`` declares (``AttnForm`` values).
FORMS = frozenset(f.value for f in AttnForm)
