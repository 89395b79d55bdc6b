"""Attention forms of MLA layers and the per-backend policy that picks one per batch.

DeepSeek-style layers can run attention in two forms: the absorbed form over the latent cache
(q/k 576, v 512), or decompressed into per-head K/V (q/k 192, v 128) and run as plain MHA,
which is cheaper for prefill without (or with a short) cached prefix. The choice belongs to
the runner's own backend (its ``form_policy``), made once per forward from the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._vocab import AttnForm as AttnForm


@dataclasses.dataclass(frozen=True, slots=True)
class FormPolicy:
    """Which ``AttnForm`` a backend uses per batch. Thresholds are backend options, not globals.

    >>> from attn_dispatch import Phase
    >>> FormPolicy(short_prefix_max=512).choose_for(Phase.PREFILL, prefix_tokens=4096)
    <AttnForm.MHA_CHUNKED: 'mha_chunked'>

    PREFILL: no cached prefix -> ``no_prefix``; at most ``short_prefix_max`` cached prefix
    tokens in the whole batch -> ``short_prefix``; more -> ``long_prefix``. DECODE and VERIFY
    use ``decode`` and ``verify``. A config that names only the absorbed form (no
    ``mha_head_dim``) always runs ``MLA``: a form the config cannot describe is never chosen.
    """

    no_prefix: AttnForm = AttnForm.MHA
    short_prefix: AttnForm = AttnForm.MHA
    long_prefix: AttnForm = AttnForm.MHA_CHUNKED
    short_prefix_max: int = 2048
    decode: AttnForm = AttnForm.MLA
    verify: AttnForm = AttnForm.MLA

    def __post_init__(self) -> None:
        for field in ("no_prefix", "short_prefix", "long_prefix", "decode", "verify"):
            value = getattr(self, field)
            try:
                object.__setattr__(self, field, AttnForm(value))
            except ValueError:
                raise InvalidSpecError(
                    field, value, f"choose one of {', '.join(repr(f.value) for f in AttnForm)}"
                ) from None
        if not isinstance(self.short_prefix_max, int) or self.short_prefix_max < 0:
            raise InvalidSpecError("short_prefix_max", self.short_prefix_max, "must be an int >= 0")

    @classmethod
    def absorbed_only(cls) -> FormPolicy:
        """Every phase in the absorbed MLA form."""
        m = AttnForm.MLA
        return cls(no_prefix=m, short_prefix=m, long_prefix=m, decode=m, verify=m)

    @classmethod
    def decompressed_without_prefix(cls) -> FormPolicy:
        """Decompressed (``MHA``) only for prefill without a cached prefix; absorbed otherwise.

        SGLang's DeepSeek handlers do this for kernels that read the paged latent cache
        directly; it is the default of the ``native``, ``triton`` and ``flashinfer`` backends.
        """
        m = AttnForm.MLA
        return cls(no_prefix=AttnForm.MHA, short_prefix=m, long_prefix=m, decode=m, verify=m)

    def choose_for(self, phase: Phase, *, prefix_tokens: int) -> AttnForm:
        if phase is Phase.DECODE:
            return self.decode
        if phase is Phase.VERIFY:
            return self.verify
        if prefix_tokens == 0:
            return self.no_prefix
        return self.short_prefix if prefix_tokens <= self.short_prefix_max else self.long_prefix

    def choose(self, batch: Any) -> AttnForm:
        """The form for ``batch`` (an ``AttnBatch``), from its host-side lengths."""
        if batch.phase is not Phase.PREFILL:
            return self.choose_for(batch.phase, prefix_tokens=0)
        if self.no_prefix is self.short_prefix is self.long_prefix:
            return self.no_prefix  # no lengths needed (e.g. absorbed_only)
        prefix = int(batch.kv_lens_host.sum()) - int(batch.num_tokens)
        return self.choose_for(Phase.PREFILL, prefix_tokens=prefix)

    def possible(self, phase: Phase) -> frozenset[AttnForm]:
        """Every form ``choose`` can return in ``phase`` (what ``bind`` checks)."""
        if phase is Phase.PREFILL:
            return frozenset({self.no_prefix, self.short_prefix, self.long_prefix})
        return frozenset({self.decode if phase is Phase.DECODE else self.verify})
