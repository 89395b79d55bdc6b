"""Names every module of the transformers integration shares: the implementation name, the
attention groups, the FP8 limits and the error type it raises (defined in the core, so the vLLM
integration shares it without importing this one)."""

from __future__ import annotations

from attn_dispatch._errors import UnsupportedModelError as UnsupportedModelError

# The name under which use() registers its attention and mask functions with transformers.
IMPLEMENTATION = "attn_dispatch"

# Largest finite value of each FP8 format: the per-layer scale maps the prefill's amax onto it.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
DEFAULT_PAGE_SIZE = 16

GROUP_CHUNKED = "chunked"
GROUP_FULL = "full"
GROUP_SLIDING = "sliding"

# The package is the public home of these names (reprs, pickles and docs show it).
_PUBLIC_MODULE = "attn_dispatch.integrations.transformers"
