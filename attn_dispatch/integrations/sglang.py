"""SGLang vocabulary -> attn_dispatch values (imports no SGLang).

    >>> from attn_dispatch.integrations.sglang import forward_phase, spec_from_server_args
    >>> spec = spec_from_server_args(server_args, is_draft=True)   # the draft runner's own spec
    >>> with attn_scope(runner, batch):     # batch.phase = forward_phase(forward_batch)
    ...     ...

The mapping itself lives in the core (``phase_of``, ``BackendSpec.from_server_args``) so that
it is tested once; this module names the SGLang-shaped entry points.
"""

from __future__ import annotations

from typing import Any

from attn_dispatch._phase import Phase
from attn_dispatch._phase import phase_of
from attn_dispatch._spec import BackendSpec


def spec_from_server_args(
    server_args: object, *, is_draft: bool = False, speculative_algorithm: str | None = None
) -> BackendSpec:
    """The ``BackendSpec`` of one runner from SGLang ``ServerArgs`` (or a mapping of them).

    Resolved values (``resolved_dict()``) when the object has them; the draft follows the
    rules of ``speculative_algorithm`` (default: ``server_args.speculative_algorithm``), as
    SGLang 0.5.23 applies them. See ``BackendSpec.from_server_args``.
    """
    return BackendSpec.from_server_args(
        server_args, is_draft=is_draft, speculative_algorithm=speculative_algorithm
    )


def forward_phase(forward_batch: Any) -> Phase:
    """The ``Phase`` of an SGLang ``ForwardBatch`` (from its ``forward_mode``), e.g.
    ``TARGET_VERIFY`` -> ``Phase.VERIFY``; an unknown mode raises ``UnknownPhaseError``."""
    return phase_of(getattr(forward_batch, "forward_mode", forward_batch))


__all__ = ["forward_phase", "phase_of", "spec_from_server_args"]
