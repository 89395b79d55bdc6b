"""Forward phases and the mapping from framework forward-mode names."""

from __future__ import annotations

import enum

from attn_dispatch._errors import UnknownPhaseError as UnknownPhaseError


class Phase(enum.Enum):
    """The phase of one forward: ``PREFILL``, ``DECODE`` or ``VERIFY``.

    Not an ``int``: a framework's own forward-mode enum (SGLang's ``ForwardMode.EXTEND`` has
    the value 1) or a bare int never equals, hashes like or dispatches as a Phase; map modes
    with ``phase_of(mode)``. Members hash by identity (in C, which keeps the dict lookup of
    ``resolve`` as cheap as a tuple index) and still index per-phase tuples
    (``__index__``: PREFILL 0, DECODE 1, VERIFY 2).
    """

    PREFILL = 0
    DECODE = 1
    VERIFY = 2

    # Identity hash and equality (the C slots of object): consistent with each other, and a
    # foreign IntEnum or int can never match a Phase key.
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __index__(self) -> int:
        return self._value_

    # Ordered as a forward goes (prefill < decode < verify), so phases sort; only against
    # other Phase members, never against ints.
    def __lt__(self, other: object) -> bool:
        if type(other) is not Phase:
            return NotImplemented
        return self._value_ < other._value_

    def __le__(self, other: object) -> bool:
        if type(other) is not Phase:
            return NotImplemented
        return self._value_ <= other._value_

    def __gt__(self, other: object) -> bool:
        if type(other) is not Phase:
            return NotImplemented
        return self._value_ > other._value_

    def __ge__(self, other: object) -> bool:
        if type(other) is not Phase:
            return NotImplemented
        return self._value_ >= other._value_

    @classmethod
    def parse(cls, value: str | Phase) -> Phase:
        """``Phase.parse("decode") is Phase.DECODE``; raises ``UnknownPhaseError``."""
        if isinstance(value, Phase):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise UnknownPhaseError(str(value), tuple(p.name.lower() for p in cls)) from None


# SGLang's ForwardMode names (checked against SGLang 0.5.23; DRAFT_EXTEND against 0.5.10-0.5.13).
# Verify-like modes are their own phase: whether they run on the prefill or the decode backend
# is the spec's `verify_mode`, never a property of the name.
# - DRAFT_EXTEND_V2 runs only on an EAGLE-family draft runner, whose backend for it is
#   DraftBackendFactory's draft-extend backend (the decode one under speculative_attention_mode
#   "decode"); `BackendSpec.from_server_args(..., is_draft=True)` names that backend for VERIFY.
#   HybridAttnBackend would send it to prefill, but EAGLE v2 replaces the draft runner's hybrid
#   backend with the draft-extend one, so no runner routes it through the hybrid.
# - DRAFT_EXTEND (SGLang <= 0.5.13, removed in 0.5.14): HybridAttnBackend routed it like
#   TARGET_VERIFY, by speculative_attention_mode.
_MODE_TO_PHASE: dict[str, Phase] = {
    "EXTEND": Phase.PREFILL,
    "MIXED": Phase.PREFILL,
    "SPLIT_PREFILL": Phase.PREFILL,
    "PREBUILT": Phase.PREFILL,
    "DLLM_EXTEND": Phase.PREFILL,
    "DECODE": Phase.DECODE,
    "IDLE": Phase.DECODE,
    "TARGET_VERIFY": Phase.VERIFY,
    "DRAFT_EXTEND_V2": Phase.VERIFY,
    "DRAFT_EXTEND": Phase.VERIFY,
    # Our own names, so phase_of(Phase.X.name) works too.
    "PREFILL": Phase.PREFILL,
    "VERIFY": Phase.VERIFY,
}


def phase_of(mode: object) -> Phase:
    """Map a framework forward-mode (SGLang ``ForwardMode`` or its name) to a ``Phase``.

    >>> phase_of("TARGET_VERIFY")
    <Phase.VERIFY: 2>

    Enum members are read by their ``name``; an unknown name raises ``UnknownPhaseError``.
    """
    if isinstance(mode, Phase):
        return mode
    name = getattr(mode, "name", mode)
    if not isinstance(name, str):
        raise UnknownPhaseError(repr(mode), tuple(sorted(_MODE_TO_PHASE)))
    phase = _MODE_TO_PHASE.get(name.strip().upper())
    if phase is None:
        raise UnknownPhaseError(name, tuple(sorted(_MODE_TO_PHASE)))
    return phase
