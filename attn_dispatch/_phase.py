"""Forward phases (``Phase``). Framework forward-mode names map to them in the framework's
integration: SGLang's in ``attn_dispatch.integrations.sglang`` (``phase_of``)."""

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
