"""attn_scope, resolve, current_binding, attention: nesting, errors, threads, asyncio tasks."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import enum
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from attn_dispatch import AttnDispatchError
from attn_dispatch import Binding
from attn_dispatch import CallError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import NoActiveScopeError
from attn_dispatch import Phase
from attn_dispatch import ScopeError
from attn_dispatch import UnknownPhaseError
from attn_dispatch import UsageError
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import carry_scope
from attn_dispatch import current_batch
from attn_dispatch import current_binding
from attn_dispatch import resolve
from attn_dispatch import run_in_thread
from attn_dispatch.backend import register_backend
from attn_dispatch.integrations.sglang import phase_of
from tests.strategies import ANY_CAPS
from tests.strategies import EchoBackend
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import register_echo

WAIT = 30.0  # seconds: a thread test fails instead of hanging


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (hung?)"


class Runner:
    def __init__(self, binding: Binding) -> None:
        self.attn_binding = binding


@pytest.fixture
def a(registry_snapshot: object) -> Binding:
    register_echo("sa")
    register_echo("sb")
    return bind("prefill=sa,decode=sb", mha_config(), label="A")


@pytest.fixture
def b(a: Binding) -> Binding:
    return bind("sb", mha_config(), label="B")


def who(phase: Phase = Phase.DECODE) -> Any:
    """The identity of the handler that serves ``phase`` here (label is not part of it)."""
    return resolve(phase)


def no_scope() -> bool:
    try:
        resolve(Phase.DECODE)
    except NoActiveScopeError:
        return True
    return False


@pytest.fixture(autouse=True)
def _clean_context() -> Iterator[None]:
    assert no_scope(), "a previous test leaked a scope"
    yield
    assert no_scope(), "this test leaked a scope"


# -- outside every scope -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "what"),
    [
        (lambda: resolve(Phase.DECODE), "resolve"),
        (current_binding, "current_binding"),
        (current_batch, "current_batch"),
        (lambda: attention(1, 2, 3, sm_scale=1.0), "attention"),
    ],
)
def test_outside_scope_raises_with_hint(call: Any, what: str) -> None:
    with pytest.raises(NoActiveScopeError) as info:
        call()
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, AttnDispatchError)
    assert err.what == what
    msg = str(err)
    assert msg.startswith(f"{what}() was called outside any attention scope")
    assert "with attn_dispatch.attn_scope(runner, batch):" in msg
    assert "run_in_thread" in msg and "copy_context().run" in msg


# -- basics and nesting --------------------------------------------------------------------------


def test_scope_with_runner_or_binding(a: Binding) -> None:
    for target in (a, Runner(a)):
        with attn_scope(target) as bound:
            assert bound is a
            assert current_binding() is a
            assert current_batch() is None
            for p in Phase:
                assert resolve(p) is a.handler(p)
        assert no_scope()


def test_nesting_innermost_wins_outer_restored(a: Binding, b: Binding) -> None:
    with attn_scope(a):
        assert resolve(Phase.PREFILL) is a.handler(Phase.PREFILL)
        with attn_scope(b):
            assert current_binding() is b
            assert resolve(Phase.PREFILL) is b.handler(Phase.PREFILL)
            with attn_scope(a):
                assert current_binding() is a
            assert current_binding() is b
        assert current_binding() is a
        assert resolve(Phase.PREFILL).backend == "sa"
    assert no_scope()


class ForwardMode(enum.IntEnum):
    """SGLang's shape: EXTEND has the value 1, which is DECODE's index."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3


@pytest.mark.parametrize(
    "phase",
    [
        "decode",
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        -1,
        None,
        True,
        1.0,
        ForwardMode.EXTEND,
        ForwardMode.DECODE,
        ForwardMode.MIXED,
        [1],
    ],
    ids=repr,
)
def test_resolve_refuses_everything_but_a_phase(a: Binding, phase: Any) -> None:
    # Before, an int 3..8 returned a frame internal (the Binding, the batch, the plan), -1
    # returned None and ForwardMode.EXTEND (== 1) dispatched as DECODE.
    with attn_scope(a, FakeBatch(Phase.DECODE)):
        with pytest.raises(UnknownPhaseError) as info:
            resolve(phase)
        err = info.value
        assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
        assert err.name == repr(phase)
        assert err.known == ("PREFILL", "DECODE", "VERIFY")
        assert "phase_of(mode)" in str(err)  # how to map a framework's mode
        assert resolve(phase_of(ForwardMode.EXTEND)) is resolve(Phase.PREFILL)  # the right way


def test_phase_is_not_an_int() -> None:
    assert Phase.DECODE != 1
    assert ForwardMode.EXTEND != Phase.DECODE
    assert {Phase.DECODE: "x"}.get(1) is None
    assert {Phase.DECODE: "x"}.get(ForwardMode.EXTEND) is None
    assert (10, 11, 12)[Phase.VERIFY] == 12 and int(Phase.DECODE) == 1  # still indexes
    assert sorted([Phase.VERIFY, Phase.PREFILL, Phase.DECODE]) == list(Phase)
    with pytest.raises(TypeError):
        _ = Phase.DECODE < 2  # type: ignore[operator]
    assert pickle.loads(pickle.dumps(Phase.VERIFY)) is Phase.VERIFY
    assert copy.deepcopy(Phase.PREFILL) is Phase.PREFILL


def _spy(seen: list[Any]) -> Any:
    class Spy(EchoBackend):
        def handler(self, phase: Phase) -> Any:
            def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> Any:
                seen.append(sm_scale)
                return "out"

            return run

    return lambda c, **o: Spy(c, name="spy")


def test_sm_scale_from_the_config(registry_snapshot: object) -> None:
    seen: list[Any] = []
    register_backend("spy", capabilities=ANY_CAPS, factory=_spy(seen))
    cfg = mha_config().replace(sm_scale=0.125)
    with attn_scope(bind("spy", cfg, label="t"), FakeBatch(Phase.DECODE)):
        attention("q", "k", "v")  # the config's
        attention("q", "k", "v", sm_scale=0.125)  # equal: fine
        attention("q", "k", "v", sm_scale=0.125 * (1 + 1e-9))  # equal up to rounding
        with pytest.raises(InvalidBatchError) as info:
            attention("q", "k", "v", sm_scale=0.25)
        err = info.value
        assert err.field == "sm_scale"
        assert "sm_scale=0.25 differs" in str(err) and "0.125" in str(err)
    assert seen == [0.125, 0.125, 0.125]  # the planned scale reaches the handler


def test_sm_scale_missing_everywhere(registry_snapshot: object) -> None:
    seen: list[Any] = []
    register_backend("spy", capabilities=ANY_CAPS, factory=_spy(seen))
    with attn_scope(bind("spy", mha_config(), label="t"), FakeBatch(Phase.DECODE)):
        with pytest.raises(InvalidBatchError) as info:
            attention("q", "k", "v")
        assert info.value.field == "sm_scale"
        assert "pass attention(..., sm_scale=s)" in str(info.value)
        assert "AttnConfig(sm_scale=s)" in str(info.value)
        attention("q", "k", "v", sm_scale=0.5)
    assert seen == [0.5]


@pytest.mark.parametrize("exc_type", [ValueError, KeyboardInterrupt, SystemExit, GeneratorExit])
def test_exceptions_restore_outer(a: Binding, b: Binding, exc_type: type[BaseException]) -> None:
    with attn_scope(a):
        with pytest.raises(exc_type):
            with attn_scope(b):
                assert current_binding() is b
                raise exc_type()
        assert current_binding() is a
    assert no_scope()


def test_generator_close_restores(a: Binding, b: Binding) -> None:
    def gen() -> Iterator[Binding]:
        with attn_scope(b):
            yield current_binding()
            yield current_binding()

    with attn_scope(a):
        g = gen()
        assert next(g) is b
        # A plain generator shares its caller's context: b is visible here until it closes.
        assert current_binding() is b
        g.close()  # GeneratorExit inside the scope
        assert current_binding() is a


def test_scope_instance_reusable_but_not_reentrant(a: Binding) -> None:
    scope = attn_scope(a)
    with scope:
        with pytest.raises(ScopeError) as info:
            scope.__enter__()
        assert "already active" in str(info.value)
        assert isinstance(info.value, RuntimeError)
        assert current_binding() is a
    assert no_scope()
    with scope:  # a closed scope may be entered again
        assert current_binding() is a
    assert no_scope()


def test_exit_without_enter(a: Binding) -> None:
    with pytest.raises(ScopeError, match="without being entered"):
        attn_scope(a).__exit__(None, None, None)


def test_out_of_order_exit(a: Binding, b: Binding) -> None:
    outer, inner = attn_scope(a), attn_scope(b)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(ScopeError) as info:
        outer.__exit__(None, None, None)
    msg = str(info.value)
    assert "attn_scope('A') exited while an inner scope ('B') was still open" in msg
    assert "reverse order" in msg
    assert no_scope()  # both closed: nothing stale stays bound
    with pytest.raises(ScopeError) as info:
        inner.__exit__(None, None, None)
    assert "attn_scope('B') was already closed: an enclosing scope exited before it" in str(
        info.value
    )
    assert no_scope()
    with inner:  # the same instance is free again, not "already active" forever
        assert current_binding() is b
    with pytest.raises(ScopeError, match="without being entered"):
        inner.__exit__(None, None, None)  # a second exit is still refused
    assert no_scope()


def test_inner_instance_reusable_without_its_own_exit(a: Binding, b: Binding) -> None:
    # The inner scope's exit may never come (an abandoned generator held it): entering the
    # same instance again must work once an enclosing scope has closed it.
    outer, inner = attn_scope(a), attn_scope(b)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(ScopeError):
        outer.__exit__(None, None, None)
    assert "closed" in repr(inner)
    with inner:
        assert current_binding() is b
        with pytest.raises(ScopeError, match="already active"):
            inner.__enter__()  # while open, re-entry is still refused
    assert no_scope()


def test_out_of_order_exit_of_three_closes_every_inner(a: Binding, b: Binding) -> None:
    s1, s2, s3 = attn_scope(a), attn_scope(b), attn_scope(a)
    for s in (s1, s2, s3):
        s.__enter__()
    with pytest.raises(ScopeError, match="reverse order"):
        s1.__exit__(None, None, None)
    assert no_scope()
    for s in (s3, s2):
        with pytest.raises(ScopeError, match="already closed"):
            s.__exit__(None, None, None)
    assert no_scope()


def test_out_of_order_exit_inside_outer_scope(a: Binding, b: Binding) -> None:
    with attn_scope(b):
        s1, s2 = attn_scope(a), attn_scope(a)
        s1.__enter__()
        s2.__enter__()
        with pytest.raises(ScopeError):
            s1.__exit__(None, None, None)
        assert current_binding() is b  # back to the scope that encloses both
        with pytest.raises(ScopeError):
            s2.__exit__(None, None, None)
        assert current_binding() is b


def test_exit_in_another_thread_raises_scope_error(a: Binding) -> None:
    scope = attn_scope(a)
    scope.__enter__()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            scope.__exit__(None, None, None)
        except BaseException as exc:
            errors.append(exc)

    for target in (close, carry_scope(close)):
        t = threading.Thread(target=target)
        t.start()
        join_all([t])
    assert len(errors) == 2
    assert all(isinstance(e, ScopeError) for e in errors), errors
    assert all("is not open in this context" in str(e) for e in errors)
    assert current_binding() is a  # the owner's context is untouched
    scope.__exit__(None, None, None)  # and the owner can still close what it opened
    assert no_scope()


def test_not_a_runner() -> None:
    with pytest.raises(InvalidSpecError) as info:
        attn_scope(object())
    assert info.value.field == "runner"
    assert "no attn_binding attribute" in str(info.value)
    assert "attn_dispatch.bind(spec, config)" in str(info.value)
    with pytest.raises(InvalidSpecError, match="got str"):
        attn_scope(Runner("torch"))  # type: ignore[arg-type]


def test_batch_without_phase(a: Binding) -> None:
    with pytest.raises(InvalidBatchError) as info:
        attn_scope(a, object())
    assert info.value.field == "phase"
    assert "has no Phase" in str(info.value)


# -- batches, planning, attention ----------------------------------------------------------------


def test_plan_once_per_scope_on_the_phase_backend(a: Binding) -> None:
    sa, sb = a.backends["sa"], a.backends["sb"]
    assert isinstance(sa, EchoBackend) and isinstance(sb, EchoBackend)
    batch = FakeBatch(Phase.DECODE)
    with attn_scope(a, batch):
        assert current_batch() is batch
        outs = [attention(i, None, None, sm_scale=0.5) for i in range(5)]
    assert sb.plans == [batch] and sa.plans == []  # decode -> sb, planned once for 5 layers
    plan = ("plan", "sb", sb.instance, 1)
    assert outs == [("sb", Phase.DECODE, sb.instance, plan)] * 5
    with attn_scope(a, FakeBatch(Phase.PREFILL)):
        out = attention(None, None, sm_scale=1.0)
    assert len(sa.plans) == 1 and len(sb.plans) == 1
    assert out[0] == "sa" and out[1] is Phase.PREFILL


def test_attention_passes_arguments_through(registry_snapshot: object) -> None:
    seen: list[tuple[Any, ...]] = []

    class Spy(EchoBackend):
        def handler(self, phase: Phase) -> Any:
            def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> Any:
                seen.append((q, k, v, plan, sm_scale))
                return "out"

            return run

    register_backend("spy", capabilities=ANY_CAPS, factory=lambda c, **o: Spy(c, name="spy"))
    binding = bind("spy", mha_config())
    with attn_scope(binding, FakeBatch(Phase.VERIFY)):
        assert attention("q", "k", "v", sm_scale=0.125) == "out"
    assert seen == [("q", "k", "v", ("plan", "spy", binding.backends["spy"].instance, 1), 0.125)]
    with pytest.raises(TypeError):
        attention("q", "k", "v", 0.1)  # type: ignore[misc]


def test_attention_without_batch(a: Binding) -> None:
    with attn_scope(a):
        # Misuse of the API (a bug in the caller), not bad batch data: a usage error.
        with pytest.raises(UsageError) as info:
            attention(1, 2, 3, sm_scale=1.0)
        err = info.value
        assert not isinstance(err, InvalidBatchError) and isinstance(err, CallError)
        assert err.api == "attention()"
        assert "needs a scope opened with a batch" in str(err)
        assert "attn_scope(runner, batch)" in str(err)


def test_plan_error_leaves_no_scope(registry_snapshot: object, a: Binding) -> None:
    class BadPlan(EchoBackend):
        def plan(self, batch: Any) -> Any:
            raise InvalidBatchError("kv_lens", "negative", request=3)

    register_backend("badplan", capabilities=ANY_CAPS, factory=lambda c, **o: BadPlan(c))
    binding = bind("badplan", mha_config())
    scope = attn_scope(binding, FakeBatch(Phase.PREFILL))
    with pytest.raises(InvalidBatchError) as info:
        with scope:
            raise AssertionError("not reached")
    assert info.value.request == 3
    assert no_scope()
    with attn_scope(a):
        with pytest.raises(InvalidBatchError):
            with attn_scope(binding, FakeBatch(Phase.DECODE)):
                pass
        assert current_binding() is a  # the outer scope is still the active one


def test_handler_error_leaves_no_scope(registry_snapshot: object) -> None:
    class Boom(EchoBackend):
        def handler(self, phase: Phase) -> Any:
            def run(*args: Any) -> Any:
                raise RuntimeError("kernel failed")

            return run

    register_backend("boom", capabilities=ANY_CAPS, factory=lambda c, **o: Boom(c))
    binding = bind("boom", mha_config())
    with pytest.raises(RuntimeError, match="kernel failed"):
        with attn_scope(binding, FakeBatch(Phase.DECODE)):
            attention(1, 2, 3, sm_scale=1.0)
    assert no_scope()


# -- decorator -----------------------------------------------------------------------------------


def test_decorator(a: Binding, b: Binding) -> None:
    @attn_scope(Runner(a))
    def forward(x: int) -> tuple[int, Binding]:
        """Docs kept."""
        return x, current_binding()

    assert forward.__name__ == "forward" and forward.__doc__ == "Docs kept."
    assert forward(1) == (1, a)
    with attn_scope(b):
        assert forward(2) == (2, a)
        assert current_binding() is b
    assert forward(3) == (3, a)  # each call opens its own scope; recursion-safe too


def test_decorator_plans_per_call(a: Binding) -> None:
    batch = FakeBatch(Phase.DECODE)

    @attn_scope(a, batch)
    def forward() -> Any:
        return attention(0, 0, sm_scale=1.0)

    first, second = forward(), forward()
    assert first[3][3] == 1 and second[3][3] == 2  # plan counter: one plan per call
    assert len(a.backends["sb"].plans) == 2


def test_decorator_async(a: Binding, b: Binding) -> None:
    @attn_scope(a)
    async def forward(x: int) -> tuple[int, Binding, Binding]:
        first = current_binding()
        await asyncio.sleep(0)
        return x, first, current_binding()

    async def main() -> None:
        assert await forward(1) == (1, a, a)
        with attn_scope(b):
            assert await forward(2) == (2, a, a)
            assert current_binding() is b
        results = await asyncio.gather(*(forward(i) for i in range(10)))
        assert results == [(i, a, a) for i in range(10)]

    assert asyncio.iscoroutinefunction(forward)
    asyncio.run(main())


def test_async_with(a: Binding) -> None:
    async def main() -> Binding:
        async with attn_scope(a) as bound:
            await asyncio.sleep(0)
            assert bound is a
            return current_binding()

    assert asyncio.run(main()) is a


# -- threads -------------------------------------------------------------------------------------


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    join_all([t])
    return out[0]


def test_plain_thread_sees_no_scope(a: Binding) -> None:
    with attn_scope(a):
        assert _in_thread(no_scope) is True
        assert current_binding() is a


def test_carry_scope(a: Binding, b: Binding) -> None:
    with attn_scope(a):
        fn = carry_scope(current_binding)
    assert no_scope()
    with attn_scope(b):
        # The scope is the one at carry time, in the worker and even here.
        assert _in_thread(fn) is a
        assert fn() is a
        assert current_binding() is b


def test_carry_scope_worker_scopes_stay_in_worker(a: Binding, b: Binding) -> None:
    def worker() -> Binding:
        with attn_scope(b):
            assert current_binding() is b
        return current_binding()

    with attn_scope(a):
        assert _in_thread(carry_scope(worker)) is a
        assert current_binding() is a


def test_carry_scope_many_threads_at_once(a: Binding) -> None:
    with attn_scope(a):
        fn = carry_scope(lambda: resolve(Phase.PREFILL))
    start = threading.Barrier(8)
    out: list[Any] = []

    def run() -> None:
        start.wait(timeout=WAIT)
        out.append(fn())  # one Context shared by many threads would raise RuntimeError

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    join_all(threads)
    assert out == [a.handler(Phase.PREFILL)] * 8


def test_run_in_thread(a: Binding) -> None:
    with attn_scope(a):
        name, binding = run_in_thread(
            lambda x: (threading.current_thread().name, current_binding()), 1
        )
    assert binding is a and name == "attn_dispatch-worker"

    def fail(kind: str) -> None:
        raise KeyError(kind)

    with pytest.raises(KeyError, match="bad"):
        run_in_thread(fail, kind="bad")
    with pytest.raises(NoActiveScopeError):
        run_in_thread(current_binding)


def test_threads_are_isolated(a: Binding, b: Binding) -> None:
    barrier = threading.Barrier(2)
    seen: dict[str, list[Binding]] = {"a": [], "b": []}

    def run(key: str, binding: Binding) -> None:
        with attn_scope(binding):
            for _ in range(50):
                barrier.wait(timeout=WAIT)
                seen[key].append(current_binding())

    ts = [threading.Thread(target=run, args=("a", a)), threading.Thread(target=run, args=("b", b))]
    for t in ts:
        t.start()
    join_all(ts)
    assert seen == {"a": [a] * 50, "b": [b] * 50}


# -- asyncio -------------------------------------------------------------------------------------


def test_asyncio_tasks_isolated(a: Binding, b: Binding) -> None:
    bindings = [a, b]

    async def task(i: int) -> list[bool]:
        mine = bindings[i % 2]
        ok = []
        with attn_scope(mine):
            for _ in range(20):
                await asyncio.sleep(0)  # let every other task run between resolves
                ok.append(current_binding() is mine)
                ok.append(resolve(Phase.PREFILL) is mine.handler(Phase.PREFILL))
        ok.append(current_binding() is b)  # back to what the task inherited from main
        return ok

    async def main() -> None:
        with attn_scope(b):
            results = await asyncio.gather(*(task(i) for i in range(20)))
            assert current_binding() is b
        assert all(all(r) for r in results)

    asyncio.run(main())


def test_task_inherits_scope_at_creation(a: Binding, b: Binding) -> None:
    async def child() -> Binding:
        await asyncio.sleep(0)
        return current_binding()

    async def main() -> None:
        with attn_scope(a):
            t = asyncio.create_task(child())
        with attn_scope(b):
            assert await t is a  # a copy of the context at create_task time

    asyncio.run(main())


def test_context_copy_is_independent(a: Binding, b: Binding) -> None:
    with attn_scope(a):
        ctx = contextvars.copy_context()
    assert ctx.run(current_binding) is a

    def enter_b() -> None:
        attn_scope(b).__enter__()  # left open inside ctx on purpose

    ctx.run(enter_b)
    assert ctx.run(current_binding) is b
    assert no_scope()


def test_decorator_refuses_generator_functions(a: Binding) -> None:
    # The scope would close before the generator body runs (or, held across yields, leak into
    # the caller between them): refuse at decoration instead of silently not applying.
    def gen() -> Iterator[Binding]:
        yield current_binding()

    async def agen() -> Any:
        yield current_binding()

    for fn in (gen, agen):
        with pytest.raises(ScopeError) as info:
            attn_scope(a)(fn)
        assert isinstance(info.value, RuntimeError)
        msg = str(info.value)
        assert f"cannot decorate the generator function {fn.__qualname__!r}" in msg
        # What is safe, and never the unsafe advice of holding the scope across a yield.
        assert "leaks into the consumer between yields" in msg
        assert "around each next()/send() in the consumer" in msg
        assert "closing it before the next `yield`" in msg
        assert "open the scope inside it instead" not in msg


def test_scope_held_across_yield_leaks_into_the_consumer(a: Binding, b: Binding) -> None:
    # Why the rule exists (docs/concepts/scope.md, "Scopes in generators"): a plain generator
    # runs in its consumer's context, so a `with` held across a `yield` is visible to the
    # consumer.
    def leaky() -> Iterator[None]:
        with attn_scope(b):
            yield

    with attn_scope(a):
        gen = leaky()
        next(gen)
        assert current_binding() is b  # the consumer now dispatches as b: the leak
        gen.close()
        assert current_binding() is a


def test_safe_generator_patterns(a: Binding, b: Binding) -> None:
    def body() -> Iterator[Binding]:
        for _ in range(2):
            with attn_scope(b):  # opened and closed between yields
                seen = current_binding()
            yield seen

    def plain() -> Iterator[Binding]:
        while True:
            yield current_binding()

    with attn_scope(a):
        assert list(body()) == [b, b]
        assert current_binding() is a
        gen = plain()
        with attn_scope(b):  # around each next() in the consumer
            assert next(gen) is b
        assert next(gen) is a


# -- out-of-order exits under threads, tasks and BaseException -----------------------------------


@pytest.mark.parametrize("exc_type", [ValueError, KeyboardInterrupt, SystemExit])
def test_out_of_order_exit_with_an_exception_in_flight(
    a: Binding, b: Binding, exc_type: type[BaseException]
) -> None:
    outer, inner = attn_scope(a), attn_scope(b)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(ScopeError):
        outer.__exit__(exc_type, exc_type(), None)
    assert no_scope()
    with pytest.raises(ScopeError, match="already closed"):
        inner.__exit__(exc_type, exc_type(), None)
    assert no_scope()


def test_out_of_order_exit_in_threads_is_private(a: Binding, b: Binding) -> None:
    # Each thread's out-of-order exit closes its own scopes only.
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def work(first: Binding, second: Binding) -> None:
        outer, inner = attn_scope(first), attn_scope(second)
        outer.__enter__()
        inner.__enter__()
        barrier.wait(timeout=WAIT)
        try:
            outer.__exit__(None, None, None)
        except ScopeError:
            pass
        barrier.wait(timeout=WAIT)
        errors.append("clean" if no_scope() else "leak")
        try:
            inner.__exit__(None, None, None)
        except ScopeError as exc:
            errors.append("closed" if "already closed" in str(exc) else str(exc))
        with inner:
            errors.append("reused" if current_binding() is second else "wrong")

    threads = [threading.Thread(target=work, args=(a, b) if i % 2 else (b, a)) for i in range(4)]
    for t in threads:
        t.start()
    join_all(threads)
    assert sorted(errors) == sorted(["clean", "closed", "reused"] * 4)
    assert no_scope()


def test_out_of_order_exit_in_asyncio_tasks(a: Binding, b: Binding) -> None:
    async def task(first: Binding, second: Binding) -> list[str]:
        got = []
        outer, inner = attn_scope(first), attn_scope(second)
        outer.__enter__()
        inner.__enter__()
        await asyncio.sleep(0)
        with pytest.raises(ScopeError):
            outer.__exit__(None, None, None)
        await asyncio.sleep(0)
        got.append("clean" if no_scope() else "leak")
        with pytest.raises(ScopeError, match="already closed"):
            inner.__exit__(None, None, None)
        async with inner:
            await asyncio.sleep(0)
            got.append("reused" if current_binding() is second else "wrong")
        return got

    async def main() -> list[list[str]]:
        return await asyncio.gather(task(a, b), task(b, a), task(a, a))

    assert asyncio.run(main()) == [["clean", "reused"]] * 3
    assert no_scope()
