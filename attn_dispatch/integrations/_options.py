"""The values an engine's configuration carries for us, checked once for every engine.

vLLM's ``additional_config`` and SGLang's ``ATTN_DISPATCH_SGLANG`` both carry runner specs
(``"target"``, ``"draft"``) and an ``"options"`` object (backend name -> factory keywords).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import FormPolicy
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
    return {name: _with_policy(name, dict(kw)) for name, kw in options.items()}


def _with_policy(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    """A ``form_policy`` written as JSON (``{"short_prefix_max": 0}``: ``FormPolicy``'s
    fields, forms by value) becomes the ``FormPolicy`` that ``bind`` takes.

    >>> _with_policy("torch", {"form_policy": {"short_prefix_max": 0}})["form_policy"]
    FormPolicy(no_prefix=<AttnForm.MHA: 'mha'>, ..., short_prefix_max=0, ...)
    """
    policy = kw.get("form_policy")
    if isinstance(policy, Mapping):
        fields = {f.name for f in dataclasses.fields(FormPolicy)}
        unknown = sorted(str(k) for k in policy if k not in fields)
        if unknown:
            raise InvalidSpecError(
                f"options[{name!r}]['form_policy']",
                dict(policy),
                f"unknown field(s) {unknown!r}; FormPolicy's fields are {sorted(fields)!r}",
            )
        kw["form_policy"] = FormPolicy(**policy)
    return kw


#: The keys of a spec that names a saved dispatch table (``tune --save``).
TABLE_KEYS = ("table", "label", "on_stale")


def spec_value(field: str, value: object) -> BackendSpec:
    """A runner's spec as a configuration writes it: a ``BackendSpec``, its dict form, text,
    or a saved dispatch table, ``{"table": path, "label": ..., "on_stale": "raise"}``.

    >>> str(spec_value("target", "prefill=torch,decode=native"))
    'prefill=torch,decode=native'

    A table is read here, once, and checked against this environment: a stale one raises
    ``StaleTableError`` naming each changed field (``"on_stale": "retune"`` measures again).
    ``label`` defaults to ``field`` (the runner: ``"target"`` or ``"draft"``, the labels
    ``tune --demo`` files its runners under). The table's runner must have one kind of layer.
    """
    if isinstance(value, BackendSpec):
        return value
    if isinstance(value, Mapping) and "table" in value:
        return _table_spec(field, value)
    if isinstance(value, Mapping):
        return BackendSpec.from_dict(dict(value))
    if not isinstance(value, str):
        raise InvalidSpecError(field, value, "expected a BackendSpec string such as 'native'")
    return BackendSpec.parse(value)


def _table_spec(field: str, value: Mapping[Any, Any]) -> BackendSpec:
    unknown = sorted(str(k) for k in value if k not in TABLE_KEYS)
    path = value["table"]
    if unknown or not isinstance(path, str) or not path:
        raise InvalidSpecError(
            field,
            dict(value),
            f"a table spec is {{'table': path, 'label': name, 'on_stale': 'raise'}} "
            f"(unknown keys: {unknown!r}; the path must be a non-empty string)",
        )
    label = value.get("label", field)
    if not isinstance(label, str):
        raise InvalidSpecError(f"{field}.label", label, "expected a runner label string")
    from attn_dispatch.dispatch_table import spec_from_table

    got = spec_from_table(path, label=label, on_stale=value.get("on_stale", "raise"))
    if isinstance(got, BackendSpec):
        return got
    raise InvalidSpecError(
        f"{field}.table",
        path,
        f"runner {label!r} of this table has layer groups {sorted(got)!r}; this engine binds "
        "one spec per runner: tune it as one kind of layer",
    )
