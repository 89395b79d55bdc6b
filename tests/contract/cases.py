"""The contract kit's cases (``attn_dispatch.testing.contract.cases``), under the name the
suite's backend tests import."""

from __future__ import annotations

from attn_dispatch.testing.contract.cases import Materialised
from attn_dispatch.testing.contract.cases import assert_lse_matches
from attn_dispatch.testing.contract.cases import config_of
from attn_dispatch.testing.contract.cases import lse_tolerance
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.cases import naive_attention
from attn_dispatch.testing.contract.cases import naive_state
from attn_dispatch.testing.contract.cases import reference_lse
from attn_dispatch.testing.contract.cases import tolerance
from attn_dispatch.testing.contract.cases import visible_keys

__all__ = [
    "Materialised",
    "assert_lse_matches",
    "config_of",
    "lse_tolerance",
    "materialise",
    "naive_attention",
    "naive_state",
    "reference_lse",
    "tolerance",
    "visible_keys",
]
