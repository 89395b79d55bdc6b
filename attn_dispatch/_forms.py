"""Attention forms of MLA layers (DeepSeek's absorbed vs decompressed computation)."""

from __future__ import annotations

import enum


class AttnForm(str, enum.Enum):
    """How an MLA layer computes attention for one batch.

    ``MLA``: absorbed form over the latent cache (q/k = latent + rope, v = latent).
    ``MHA``: decompressed form: the caller up-projects the latent of the whole sequence into
    per-head K/V (e.g. 192/128) and runs plain MHA in one shot.
    ``MHA_CHUNKED``: decompressed form with the cached prefix up-projected and attended in
    chunks (bounded memory for long prefixes), the new tokens last.
    """

    MLA = "mla"
    MHA = "mha"
    MHA_CHUNKED = "mha_chunked"
