"""``bind``'s per-backend options as an engine's configuration writes them (shared by engines).

vLLM's ``additional_config`` and SGLang's ``ATTN_DISPATCH_SGLANG`` both carry an ``"options"``
object, backend name -> factory keywords; both check it the same way, here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError


def backend_options(options: object, *, example: str) -> dict[str, dict[str, Any]]:
    """``options`` checked and copied: a mapping of backend name -> mapping of keyword -> value.

    ``example`` is the configuration's own spelling of a valid value (JSON or Python), shown
    in the error.

    >>> backend_options({"native": {"cascade": False}}, example="")
    {'native': {'cascade': False}}
    >>> backend_options({"native": 1}, example='{"native": {"cascade": false}}')
    Traceback (most recent call last):
    ...
    attn_dispatch.InvalidSpecError: ...
    """
    if not isinstance(options, Mapping) or not all(
        isinstance(name, str) and isinstance(kw, Mapping) and all(isinstance(k, str) for k in kw)
        for name, kw in options.items()
    ):
        raise InvalidSpecError(
            "options", options, f"expected backend name -> keywords, such as {example}"
        )
    return {name: dict(kw) for name, kw in options.items()}
