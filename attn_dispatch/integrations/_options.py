"""The values an engine's configuration carries for us, checked once for every engine.

vLLM's ``additional_config`` and SGLang's ``ATTN_DISPATCH_SGLANG`` both carry runner specs
(``"target"``, ``"draft"``) and an ``"options"`` object (backend name -> factory keywords).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._spec import BackendSpec


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


def spec_value(field: str, value: object) -> BackendSpec:
    """A runner's spec as a configuration writes it: a ``BackendSpec``, its dict form, or text.

    >>> str(spec_value("target", "prefill=torch,decode=native"))
    'prefill=torch,decode=native'
    """
    if isinstance(value, BackendSpec):
        return value
    if isinstance(value, Mapping):
        return BackendSpec.from_dict(dict(value))
    if not isinstance(value, str):
        raise InvalidSpecError(field, value, "expected a BackendSpec string such as 'native'")
    return BackendSpec.parse(value)
