"""The float64 reference oracle: the contract kit's (``attn_dispatch.testing.contract.oracle``),
under the name the suite's numeric tests import (``from tests import oracle``)."""

from __future__ import annotations

from attn_dispatch.testing.contract.oracle import batch_layout
from attn_dispatch.testing.contract.oracle import reference
from attn_dispatch.testing.contract.oracle import reference_for_batch
from attn_dispatch.testing.contract.oracle import reference_state
from attn_dispatch.testing.contract.oracle import reference_state_for_batch
from attn_dispatch.testing.contract.oracle import visible_keys

__all__ = [
    "batch_layout",
    "reference",
    "reference_for_batch",
    "reference_state",
    "reference_state_for_batch",
    "visible_keys",
]
