"""The ``torch`` reference backend: capabilities only (the kernels are in ``backend.py``)."""

from __future__ import annotations

from attn_dispatch._capabilities import Capabilities

CAPABILITIES = Capabilities(
    kinds={"mha", "mla"},
    devices={"cpu", "cuda"},
    dtypes={"float32", "float16", "bfloat16"},
    custom_mask=True,
    requires=("torch",),
    forms={"mla", "mha", "mha_chunked"},
    description="plain PyTorch reference: defines the numbers (fp32 accumulation)",
)
