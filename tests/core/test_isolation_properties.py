"""Isolation as a property: random programs of runners, scopes, threads, tasks and generators.

The machine keeps a model of the scope stack of one "main" context (a private
``contextvars.Context``, so nothing leaks into pytest's own) and checks after every step that

* every ``resolve(phase)`` returns the handler of the innermost scope of its own context (and
  that handler's identifying value names the binding's backend for that phase);
* outside every scope ``resolve``/``current_binding`` raise ``NoActiveScopeError``;
* no Binding ever changes, whatever happens to the registry;
* a runner bound with groups, opened anywhere in the stack (or carried into a thread), serves
  ``attention(..., group=g)`` with group g's own handler and plan, each group planned exactly
  once per forward, and a call naming no group or an unknown one changes nothing.

ContextVar semantics are modelled exactly: a plain (or async) generator shares its caller's
context, so a scope it opens and leaves open across a ``yield`` is the caller's innermost scope
until the generator closes it; a thread starts empty unless the context is carried; a task
starts with a copy of its creator's context.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
from collections.abc import Callable
from collections.abc import Generator
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from attn_dispatch import BackendSpec
from attn_dispatch import Binding
from attn_dispatch import NoActiveScopeError
from attn_dispatch import Phase
from attn_dispatch import ScopeError
from attn_dispatch import UsageError
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import carry_scope
from attn_dispatch import current_binding
from attn_dispatch import resolve
from attn_dispatch.backend import register_backend
from tests.strategies import ANY_CAPS
from tests.strategies import EchoBackend
from tests.strategies import EchoHandler
from tests.strategies import FakeBatch
from tests.strategies import RegistrySnapshot
from tests.strategies import echo_factory
from tests.strategies import mha_config
from tests.strategies import mla_config

EXCEPTIONS = (ValueError, RuntimeError, KeyboardInterrupt, SystemExit, GeneratorExit)
picks = st.integers(min_value=0, max_value=10_000)


def expect(binding: Binding | None) -> None:
    """Assert that this context's innermost scope is ``binding`` (None: no scope at all)."""
    if binding is None:
        for phase in Phase:
            try:
                resolve(phase)
            except NoActiveScopeError:
                continue
            raise AssertionError(f"resolve({phase!r}) worked outside every scope")
        try:
            current_binding()
        except NoActiveScopeError:
            return
        raise AssertionError("current_binding() worked outside every scope")
    assert current_binding() is binding
    for phase in Phase:
        handler = resolve(phase)
        assert handler is binding.handler(phase)
        out = handler(None, None, None, None, 1.0)
        assert isinstance(handler.__wrapped__, EchoHandler)  # behind the call checks
        assert out[0] == binding.spec.names[phase] and out[1] is phase
        assert out[2] == handler.instance


@dataclasses.dataclass(eq=False)
class Entry:
    """One open scope of the main context, opened by a ``with`` (scope) or a generator."""

    binding: Binding
    scope: attn_scope | None = None
    gen: Generator[None, Binding | None, None] | None = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    spec: BackendSpec
    handlers: tuple[Any, ...]
    backends: tuple[tuple[str, Any], ...]


def snapshot(b: Binding) -> Snapshot:
    return Snapshot(b.spec, tuple(b.handler(p) for p in Phase), tuple(sorted(b.backends.items())))


def scoped_generator(binding: Binding) -> Generator[None, Binding | None, None]:
    """Opens a scope, then on each resume checks that it sees what the caller says it should
    (the caller's innermost scope, shared context)."""
    with attn_scope(binding):
        expect(binding)
        while True:
            seen = yield None
            expect(seen)


class IsolationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.snap = RegistrySnapshot()
        self.ctx = contextvars.Context()
        self.names: list[str] = []
        self.runners: list[Binding] = []
        self.snapshots: dict[int, Snapshot] = {}
        self.stack: list[Entry] = []
        self.dead: list[Entry] = []  # scopes closed under them by an out-of-order exit
        self.counter = 0
        self.grouped: list[Binding] = []

    # -- helpers -------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.ctx.run(fn, *args)

    def top(self) -> Binding | None:
        return self.stack[-1].binding if self.stack else None

    def runner(self, i: int) -> Binding:
        return self.runners[i % len(self.runners)]

    def new_name(self) -> str:
        self.counter += 1
        return f"iso{self.counter}"

    def close_entry(self, entry: Entry) -> None:
        """Exit ``entry`` in the main context; model what attn_scope must do."""

        def exit_it() -> None:
            if entry.gen is not None:
                entry.gen.close()
            else:
                assert entry.scope is not None
                entry.scope.__exit__(None, None, None)

        if entry in self.dead:
            # Already closed by an out-of-order exit: refused, and nothing changes.
            self.dead.remove(entry)
            try:
                self.run(exit_it)
            except ScopeError as exc:
                assert "was already closed: an enclosing scope exited before it" in str(exc)
            else:
                raise AssertionError("exiting a scope that is no longer open did not raise")
            return
        idx = self.stack.index(entry)
        if idx == len(self.stack) - 1:
            self.run(exit_it)
            self.stack.pop()
            return
        # Out of order: the context goes back to this entry's parent; inner ones are dead.
        try:
            self.run(exit_it)
        except ScopeError as exc:
            assert "still open; scopes must exit in reverse order" in str(exc)
        else:
            raise AssertionError("out-of-order exit did not raise")
        self.dead.extend(self.stack[idx + 1 :])
        del self.stack[idx:]

    # -- set-up --------------------------------------------------------------------------------

    @initialize(n=st.integers(1, 3))
    def start(self, n: int) -> None:
        for _ in range(n):
            self.register(replace_existing=False, pick=0, mla=False)
        self.new_runner(0, 0, None, False, "prefill")

    def teardown(self) -> None:
        try:
            for entry in reversed(self.stack + self.dead):
                try:
                    self.close_entry(entry)
                except Exception:
                    pass
        finally:
            self.snap.restore()

    # -- registry and runners ------------------------------------------------------------------

    @rule(replace_existing=st.booleans(), pick=picks, mla=st.booleans())
    def register(self, replace_existing: bool, pick: int, mla: bool) -> None:
        caps = ANY_CAPS if not mla else ANY_CAPS.replace(kinds=frozenset({"mla"}))
        if replace_existing and self.names:
            name = self.names[pick % len(self.names)]
            register_backend(name, capabilities=caps, factory=echo_factory(name), replace=True)
        else:
            name = self.new_name()
            register_backend(name, capabilities=caps, factory=echo_factory(name))
            self.names.append(name)

    @rule(
        p=picks,
        d=picks,
        v=st.none() | picks,
        mla=st.booleans(),
        mode=st.sampled_from(["prefill", "decode"]),
    )
    def new_runner(self, p: int, d: int, v: int | None, mla: bool, mode: str) -> None:
        pick = lambda i: self.names[i % len(self.names)]  # noqa: E731
        spec = BackendSpec(pick(p), pick(d), None if v is None else pick(v), mode)  # type: ignore[arg-type]
        config = mla_config() if mla else mha_config()
        try:
            binding = bind(spec, config, label=f"r{len(self.runners)}")
        except Exception as exc:  # an MLA-only backend asked to serve MHA: refused, fine
            from attn_dispatch import IncompatibleBackendError

            assert isinstance(exc, IncompatibleBackendError)
            assert "kind 'mha' is not supported" in str(exc)
            return
        for phase in Phase:
            assert binding.handler(phase).backend == spec.backend_for(phase)
        self.runners.append(binding)
        self.snapshots[id(binding)] = snapshot(binding)

    @rule(
        picks_=st.lists(picks, min_size=1, max_size=4),
        shared=st.booleans(),
    )
    def new_grouped_runner(self, picks_: list[int], shared: bool) -> None:
        pick = lambda i: self.names[i % len(self.names)]  # noqa: E731
        groups = {f"g{i}": mha_config(head_dim=32 * (i + 1)) for i in range(len(picks_))}
        spec: Any = (
            pick(picks_[0]) if shared else {g: pick(i) for g, i in zip(groups, picks_, strict=True)}
        )
        try:
            binding = bind(spec, groups, label=f"grouped{len(self.grouped)}")
        except Exception as exc:
            from attn_dispatch import IncompatibleBackendError

            assert isinstance(exc, IncompatibleBackendError)
            assert "kind 'mha' is not supported" in str(exc)
            return
        assert list(binding.groups) == list(groups)
        self.grouped.append(binding)

    @precondition(lambda self: self.grouped)
    @rule(
        r=picks,
        phase=st.sampled_from(list(Phase)),
        calls=st.lists(picks, min_size=1, max_size=8),
        thread=st.booleans(),
    )
    def grouped_forward(self, r: int, phase: Phase, calls: list[int], thread: bool) -> None:
        binding = self.grouped[r % len(self.grouped)]
        names = list(binding.groups)
        outer = self.top()

        def plans(b: Binding) -> int:
            backend = b.backend(phase)
            assert isinstance(backend, EchoBackend)
            return len(backend.plans)

        before = {g: plans(b) for g, b in binding.groups.items()}

        def layers() -> None:
            for c in calls:
                g = names[c % len(names)]
                child = binding.groups[g]
                out = attention(None, None, None, sm_scale=1.0, group=g)
                assert out[:3] == (child.spec.names[phase], phase, child.handler(phase).instance)
                assert out[3][1:3] == (child.spec.names[phase], child.backend(phase).instance)
            for bad in (None, "nope"):
                try:
                    attention(None, None, None, sm_scale=1.0, group=bad)
                except UsageError as exc:  # a call naming no group of the runner: misuse
                    assert exc.api == "attention(group=...)"
                else:
                    raise AssertionError(f"group={bad!r} on a grouped runner did not raise")

        def body() -> None:
            with attn_scope(binding, FakeBatch(phase)):
                if thread:
                    errors: list[BaseException] = []

                    def work() -> None:
                        try:
                            layers()
                        except BaseException as exc:  # re-raised in the main thread
                            errors.append(exc)

                    worker = threading.Thread(target=carry_scope(work))
                    worker.start()
                    worker.join()
                    if errors:
                        raise errors[0]
                else:
                    layers()
            expect(outer)

        self.run(body)
        for g, b in binding.groups.items():
            # Each group's backend planned once for this forward (a backend object may serve
            # several phases of its group, but only this phase's one planned).
            assert plans(b) == before[g] + 1

    # -- scopes in the main context ------------------------------------------------------------

    @precondition(lambda self: self.runners)
    @rule(r=picks)
    def enter(self, r: int) -> None:
        binding = self.runner(r)
        scope = attn_scope(binding)
        assert self.run(scope.__enter__) is binding
        self.stack.append(Entry(binding, scope=scope))

    @precondition(lambda self: self.stack)
    @rule()
    def exit_innermost(self) -> None:
        self.close_entry(self.stack[-1])

    @precondition(lambda self: len(self.stack) > 1)
    @rule(i=picks)
    def exit_out_of_order(self, i: int) -> None:
        self.close_entry(self.stack[i % (len(self.stack) - 1)])

    @precondition(lambda self: self.dead)
    @rule(i=picks)
    def exit_dead(self, i: int) -> None:
        self.close_entry(self.dead[i % len(self.dead)])

    @precondition(lambda self: self.runners)
    @rule(r=picks, exc=st.sampled_from(EXCEPTIONS), nested=st.booleans())
    def raise_inside(self, r: int, exc: type[BaseException], nested: bool) -> None:
        binding = self.runner(r)
        outer = self.top()

        def body() -> None:
            try:
                with attn_scope(binding):
                    expect(binding)
                    if nested:
                        with attn_scope(outer or binding):
                            raise exc("boom")
                    raise exc("boom")
            except exc:
                pass
            expect(outer)

        self.run(body)

    # -- generators ----------------------------------------------------------------------------

    @precondition(lambda self: self.runners)
    @rule(r=picks)
    def generator_opens_scope(self, r: int) -> None:
        binding = self.runner(r)
        gen = scoped_generator(binding)
        self.run(next, gen)  # opens its scope and yields with it open
        self.stack.append(Entry(binding, gen=gen))

    @precondition(lambda self: any(e.gen is not None for e in self.stack))
    @rule(i=picks)
    def generator_resumes(self, i: int) -> None:
        gens = [e for e in self.stack if e.gen is not None]
        entry = gens[i % len(gens)]
        assert entry.gen is not None
        self.run(entry.gen.send, self.top())  # it sees the caller's innermost scope

    @precondition(lambda self: any(e.gen is not None for e in self.stack))
    @rule(i=picks)
    def generator_closes(self, i: int) -> None:
        gens = [e for e in self.stack if e.gen is not None]
        self.close_entry(gens[i % len(gens)])

    # -- threads -------------------------------------------------------------------------------

    @precondition(lambda self: self.runners)
    @rule(
        rs=st.lists(picks, min_size=1, max_size=3),
        carry=st.lists(st.booleans(), min_size=3, max_size=3),
    )
    def threads(self, rs: list[int], carry: list[bool]) -> None:
        outer = self.top()
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(rs))

        def work(binding: Binding, expected: Binding | None) -> None:
            try:
                expect(expected)
                barrier.wait(timeout=10)
                with attn_scope(binding):
                    expect(binding)
                    barrier.wait(timeout=10)  # all threads inside their scopes at once
                    expect(binding)
                expect(expected)
            except BaseException as exc:
                errors.append(exc)

        threads = []
        for k, r in enumerate(rs):
            binding = self.runner(r)
            if carry[k]:
                target = self.run(carry_scope, work)
                threads.append(threading.Thread(target=target, args=(binding, outer)))
            else:
                threads.append(threading.Thread(target=work, args=(binding, None)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.run(expect, outer)

    # -- asyncio -------------------------------------------------------------------------------

    @precondition(lambda self: self.runners)
    @rule(
        tasks=st.lists(
            st.tuples(picks, st.integers(0, 3), st.none() | picks, st.booleans()),
            min_size=1,
            max_size=6,
        )
    )
    def asyncio_tasks(self, tasks: list[tuple[int, int, int | None, bool]]) -> None:
        outer = self.top()

        async def agen(binding: Binding) -> Any:
            with attn_scope(binding):
                while True:
                    yield current_binding()

        async def task(
            binding: Binding, awaits: int, inner: Binding | None, use_agen: bool
        ) -> None:
            expect(outer)  # a task starts with a copy of its creator's context
            with attn_scope(binding):
                for _ in range(awaits):
                    await asyncio.sleep(0)  # every other task runs here
                    expect(binding)
                    if inner is not None:
                        with attn_scope(inner):
                            await asyncio.sleep(0)
                            expect(inner)
                        expect(binding)
                if use_agen:
                    g = agen(inner or binding)
                    assert await g.__anext__() is (inner or binding)
                    await asyncio.sleep(0)
                    expect(inner or binding)  # the suspended agen's scope is this task's
                    await g.aclose()
                expect(binding)
            expect(outer)

        async def main() -> None:
            await asyncio.gather(
                *(
                    task(self.runner(r), n, None if i is None else self.runner(i), g)
                    for r, n, i, g in tasks
                )
            )
            expect(outer)

        self.run(asyncio.run, main())
        self.run(expect, outer)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def innermost_wins(self) -> None:
        self.run(expect, self.top())

    @invariant()
    def bindings_never_change(self) -> None:
        for b in self.runners:
            assert snapshot(b) == self.snapshots[id(b)]

    @invariant()
    def pytest_context_untouched(self) -> None:
        expect(None)


TestIsolation = IsolationMachine.TestCase
