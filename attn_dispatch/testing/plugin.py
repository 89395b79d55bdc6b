"""The pytest plugin of ``attn_dispatch.testing`` (entry point ``pytest11``: attn_dispatch).

Inert unless a test uses it: it registers one marker and defines one fixture, and records
nothing until the fixture is requested.

- fixture ``attn_dispatch_rows``: a ``RowRecorder`` recording this test's attention calls
  (from the fixture's set-up to its teardown). ``attn_dispatch_rows.rows_of("target")``.
- ``assert_rows(recorder, label, spec, *, phases=None)``: every row of runner ``label``
  names the backend ``spec`` gives its phase; with ``phases``, exactly those phases ran.
- marker ``@pytest.mark.attn_dispatch_expect("target", "prefill=torch,decode=native")``:
  records the test and checks the runner's rows with ``assert_rows`` after it passes.
- option ``--attn-backend NAME`` (repeatable, or comma-separated) and the fixtures
  ``attn_backend`` and ``attn_contract_profile``, for the contract kit:
  ``pytest --pyargs attn_dispatch.testing.contract --attn-backend NAME``
  (``attn_dispatch.testing.contract``). A test that asks for ``attn_backend`` runs once per
  name given; without the option it skips. A conftest may override either fixture.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import pytest

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec
from attn_dispatch.testing._rows import RowRecorder
from attn_dispatch.testing._rows import format_rows
from attn_dispatch.testing._rows import phase_name
from attn_dispatch.testing._rows import record_rows

MARKER = "attn_dispatch_expect"
KIT_USAGE = "pytest --pyargs attn_dispatch.testing.contract --attn-backend NAME"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn_dispatch", "attn_dispatch contract kit")
    group.addoption(
        "--attn-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="registered attention backend(s) the contract kit checks (repeat the option or "
        f"separate names with commas): {KIT_USAGE}",
    )


def backend_names(config: pytest.Config) -> list[str]:
    """The names given with ``--attn-backend``, in order, without repeats."""
    names: list[str] = []
    for value in config.getoption("attn_backend", default=None) or []:
        for name in str(value).split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = backend_names(metafunc.config)
    if names and "attn_backend" in metafunc.fixturenames:
        metafunc.parametrize("attn_backend", names)


@pytest.fixture
def attn_backend() -> str:
    """The backend name the contract kit checks: one of ``--attn-backend``'s (the test is
    parametrised over them); without the option the test skips."""
    pytest.skip(f"no backend to check: run {KIT_USAGE}")


@pytest.fixture
def attn_contract_profile() -> Any:
    """The kit's ``ContractProfile`` for the backend (``None``: the kit's defaults); override
    it in a conftest to draw more examples or narrower shapes."""
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(label, spec, phases=None): check after the test that every attention call "
        "of runner `label` ran the backend `spec` names for its phase (attn_dispatch.testing)",
    )


def assert_rows(
    recorder: RowRecorder,
    label: str,
    spec: BackendSpec | str,
    *,
    phases: Iterable[Phase | str] | None = None,
) -> None:
    """AssertionError unless runner ``label`` made calls, each on the backend ``spec`` names
    for its phase (and, with ``phases``, in exactly those phases). Bad arguments raise
    ``InvalidSpecError`` (or ``UnknownPhaseError`` for a phase name)."""
    if not isinstance(recorder, RowRecorder):
        raise InvalidSpecError(
            "recorder", recorder, "pass the RowRecorder of record_rows() or attn_dispatch_rows"
        )
    if label is not None and not isinstance(label, str):
        raise InvalidSpecError("label", label, "pass the runner's label (a string), or None")
    spec = BackendSpec.parse(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, BackendSpec):
        raise InvalidSpecError("spec", spec, "pass a BackendSpec or a spec string")
    if phases is not None and (
        isinstance(phases, (str, Phase)) or not isinstance(phases, Iterable)
    ):
        raise InvalidSpecError(
            "phases", phases, "pass an iterable of phase names (['prefill', 'decode']) or None"
        )
    rows = recorder.rows_of(label)
    problems = []
    if not rows:
        seen = ", ".join(repr(r) for r in recorder.runners()) or "none"
        problems.append(f"runner {label!r} made no attention calls (runners that did: {seen})")
    for r in rows:
        want = spec.backend_for(Phase.parse(r.phase))
        if r.backend != want:
            problems.append(f"{r.phase}: ran backend {r.backend!r}, the spec names {want!r}")
    if phases is not None:
        want_phases = {phase_name(p) for p in phases}
        ran = {r.phase for r in rows}
        if ran != want_phases:
            problems.append(f"phases run: {sorted(ran)!r}, expected {sorted(want_phases)!r}")
    if problems:
        lines = [f"runner {label!r} did not dispatch as its spec ({spec}) says:"]
        lines += [f"  - {p}" for p in problems]
        lines += ["  every row recorded:", format_rows(recorder.rows(), indent="    ")]
        raise AssertionError("\n".join(lines))


@pytest.fixture
def attn_dispatch_rows() -> Iterator[RowRecorder]:
    """Record this test's attention calls as dispatch rows (``attn_dispatch.testing``)."""
    with record_rows() as rec:
        yield rec


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    markers = list(item.iter_markers(MARKER))
    if not markers:  # inert: no recorder, no cost
        return (yield)
    for m in markers:  # a malformed marker fails before the test runs, saying how to write it
        _check_marker(item, m)
    with record_rows() as rec:
        result = yield  # a failing test raises here: its own failure is the one reported
    for m in markers:
        assert_rows(rec, *m.args, **m.kwargs)
    return result


_USAGE = f'@pytest.mark.{MARKER}("target", "prefill=torch,decode=native", phases=None)'


def _check_marker(item: pytest.Item, mark: pytest.Mark) -> None:
    """Refuse (``InvalidSpecError``) a marker that does not give a label and a spec."""
    problem = None
    unknown = sorted(set(mark.kwargs) - {"label", "spec", "phases"})
    given = len(mark.args) + sum(k in mark.kwargs for k in ("label", "spec"))
    if unknown:
        problem = f"unknown keyword(s) {', '.join(unknown)}"
    elif len(mark.args) > 2 or given != 2:
        problem = f"it needs a runner label and a spec, got {mark.args!r}, {mark.kwargs!r}"
    if problem is not None:
        raise InvalidSpecError(f"{item.nodeid}: {MARKER}", mark.args, f"{problem}; write {_USAGE}")
    label = mark.args[0] if mark.args else mark.kwargs["label"]
    spec = mark.args[1] if len(mark.args) > 1 else mark.kwargs["spec"]
    if label is not None and not isinstance(label, str):
        raise InvalidSpecError(f"{item.nodeid}: {MARKER} label", label, f"write {_USAGE}")
    if not isinstance(spec, (str, BackendSpec)):
        raise InvalidSpecError(f"{item.nodeid}: {MARKER} spec", spec, f"write {_USAGE}")
    if isinstance(spec, str):
        BackendSpec.parse(spec)  # a bad spec string: its own error, before the test runs
