"""The contract kit: the attention contract suite and its float64 oracle, for any backend.

A backend package checks itself in its own CI, against the backend name its entry point
registers::

    pip install "attn_dispatch[testing]" my-backend-package
    pytest --pyargs attn_dispatch.testing.contract --attn-backend mine

or from Python (``run`` calls pytest in this process, so a backend registered by code before
the call is checked too)::

    from attn_dispatch.testing.contract import run

    report = run("mine")
    assert report.ok, report

The suite covers every phase, kind, compute dtype, layer variant, FP8 format, MLA form and
``return_lse`` the backend's ``Capabilities`` declare, against the oracle
(``attn_dispatch.testing.contract.oracle``): hypothesis-drawn cases within the shapes it
declares, fixed edge cases, and the safety rules (inputs untouched, deterministic results,
bad tensors refused with ``InvalidBatchError``, keys a row cannot see never reaching it), and
the caller's output buffer (``attention(..., out=buf)``: the same bits as without it, bad
buffers refused; the handler's own checks when it declares ``out_buffer``).
Whatever the backend does not declare is skipped with the reason its capabilities give.

- ``oracle``: the float64 reference, the contract written out once (imports torch).
- ``cases``: ``KernelCase``, the strategies that draw cases, ``materialise`` and tolerances.
- ``harness``: ``Subject`` (the backend under test), ``ContractProfile`` (examples, limits),
  ``limits_for`` (shapes from capabilities).
- The pytest plugin (``attn_dispatch.testing.plugin``) adds ``--attn-backend NAME`` (repeat it
  or separate names with commas) and the fixtures ``attn_backend`` and
  ``attn_contract_profile``, which a conftest may override.

Importing this package imports neither torch nor pytest; its modules need torch, pytest and
hypothesis (``attn_dispatch[testing]`` plus torch).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from collections.abc import Sequence
from typing import Any

from attn_dispatch import _env

__all__ = ["ContractReport", "run"]

PLUGIN = "attn_dispatch.testing.plugin"


@dataclasses.dataclass(frozen=True)
class ContractReport:
    """What one run of the kit found: test ids that passed, failed (with pytest's report
    text) and skipped (with the reason), and pytest's exit code. ``ok``: no failure and at
    least one test passed. ``str()`` is a summary naming every failure."""

    backend: str
    exit_code: int
    passed: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    skipped: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.failed and bool(self.passed)

    def __str__(self) -> str:
        lines = [
            f"contract kit on backend {self.backend!r}: {len(self.passed)} passed, "
            f"{len(self.failed)} failed, {len(self.skipped)} skipped (pytest exit "
            f"{self.exit_code})"
        ]
        lines += [f"  FAILED {nodeid}" for nodeid, _ in self.failed]
        return "\n".join(lines)


class _Collector:
    """A pytest plugin object that keeps every test's outcome."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.passed and report.when == "call":
            self.passed.append(report.nodeid)
        elif report.failed:
            self.failed.append((report.nodeid, str(report.longreprtext)))
        elif report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skipped.append((report.nodeid, str(reason)))

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append((report.nodeid or "<collection>", str(report.longreprtext)))


def _plugin_autoloads() -> bool:
    if os.environ.get(_env.PYTEST_DISABLE_PLUGIN_AUTOLOAD):
        return False
    return any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))


def run(backend: str, args: Sequence[str] = (), *, quiet: bool = True) -> ContractReport:
    """Run the kit against the registered backend ``backend`` in this process.

    ``args`` go to pytest as well (``["-k", "edge"]``, ``["-x"]``); ``quiet`` passes ``-q``.
    Needs pytest, hypothesis and torch.

    >>> from attn_dispatch.testing.contract import run
    >>> report = run("torch", ["-k", "test_edge_cases and decode"])  # doctest: +SKIP
    >>> report.ok, len(report.passed)  # doctest: +SKIP
    (True, 1)
    """
    import pytest

    argv = ["--pyargs", __name__, "--attn-backend", backend, "-p", "no:cacheprovider"]
    # attn_dispatch is imported already (this module is in it): pytest cannot rewrite the
    # asserts of its plugin module, and says so; the kit's asserts carry their own messages.
    argv += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if not _plugin_autoloads():
        argv += ["-p", PLUGIN]
    if quiet:
        argv.append("-q")
    collector = _Collector()
    code = pytest.main([*argv, *args], plugins=[collector])
    return ContractReport(
        backend=backend,
        exit_code=int(code),
        passed=tuple(collector.passed),
        failed=tuple(collector.failed),
        skipped=tuple(collector.skipped),
    )
