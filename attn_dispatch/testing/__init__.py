"""Isolation checks for frameworks that adopt attn_dispatch (extra: ``attn_dispatch[testing]``).

A framework's own test suite can check that a runner (the target) dispatches the same kernels
with other runners alive (its draft, the draft's children, an encoder) as it does alone: the
bug family of SGLang 28528 (a draft's start-up changing the target's kernels), caught in CI.

.. code-block:: python

    from attn_dispatch.testing import assert_isolated

    assert_isolated("target", alone=serve_target, together=serve_with_draft)

- ``assert_isolated(label, alone, together)``: compare runner ``label``'s dispatch rows.
- ``record_rows()``: record rows (runner, phase, group, backend, form, config, calls).
- ``Ledger``: a runner's choices without counts or order, with a fingerprint stable across
  runs and processes, to store and diff in CI.
- ``attn_dispatch.testing.strategies``: hypothesis strategies (imports hypothesis).
- ``attn_dispatch.testing.plugin``: the pytest plugin (fixture ``attn_dispatch_rows``, marker
  ``attn_dispatch_expect``), loaded by the ``pytest11`` entry point; inert unless used.

Importing this module imports neither torch nor hypothesis.
"""

from __future__ import annotations

from attn_dispatch.testing._isolation import Isolation
from attn_dispatch.testing._isolation import assert_isolated
from attn_dispatch.testing._rows import DispatchRow
from attn_dispatch.testing._rows import Ledger
from attn_dispatch.testing._rows import RowRecorder
from attn_dispatch.testing._rows import config_fingerprint
from attn_dispatch.testing._rows import format_rows
from attn_dispatch.testing._rows import ledgers
from attn_dispatch.testing._rows import record_rows

# Public names report their public module (repr, pickling by reference, docs).
for _name in (
    "DispatchRow",
    "Isolation",
    "Ledger",
    "RowRecorder",
    "assert_isolated",
    "config_fingerprint",
    "format_rows",
    "ledgers",
    "record_rows",
):
    globals()[_name].__module__ = __name__
del _name

__all__ = [
    "DispatchRow",
    "Isolation",
    "Ledger",
    "RowRecorder",
    "assert_isolated",
    "config_fingerprint",
    "format_rows",
    "ledgers",
    "record_rows",
]
