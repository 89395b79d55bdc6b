"""The ``torch`` reference backend: capabilities only (the kernels are in ``backend.py``)."""

from __future__ import annotations

from attn_dispatch.backend import COMPUTE_DTYPES
from attn_dispatch.backend import FP8_DTYPES
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy

#: The form policy of MLA configs unless the ``form_policy`` option says otherwise.
DEFAULT_FORM_POLICY = FormPolicy()

CAPABILITIES = Capabilities(
    kinds={"mha", "mla"},
    devices={"cpu", "cuda"},
    dtypes={"float32", "float16", "bfloat16"},
    kv_dtypes={*COMPUTE_DTYPES, *FP8_DTYPES},
    custom_mask=True,
    out_buffer=True,
    variants={"window", "logit_cap", "sinks", "non_causal", "chunked", "lse"},
    requires=("torch",),
    forms={"mla", "mha", "mha_chunked"},
    description="plain PyTorch reference: defines the numbers (fp32 accumulation)",
)
