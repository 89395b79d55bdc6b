"""Reliability of the core (issue 22): plans accepted by identity only, one validation of every
config value and call argument on every path, scopes and graphs, our errors for raw ones.

Each test here failed on the code before the fix (the comment says how)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import BackendUnavailableError  # noqa: E402
from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import InvalidSpecError  # noqa: E402
from attn_dispatch import NoActiveScopeError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch import ScopeError  # noqa: E402
from attn_dispatch import UsageError  # noqa: E402
from attn_dispatch import attention  # noqa: E402
from attn_dispatch import attn_scope  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch import current_binding  # noqa: E402
from attn_dispatch import resolve  # noqa: E402
from attn_dispatch.backend import BackendBase  # noqa: E402
from attn_dispatch.backend import Capabilities  # noqa: E402
from attn_dispatch.backend import Registry  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402

NATIVE = load()
needs_native = pytest.mark.skipif(isinstance(NATIVE, str), reason=f"native library: {NATIVE}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 10.0  # seconds any thread waits for another before the test fails


def cfg(**changes: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4
    )
    base.update(changes)
    return AttnConfig(**base)


def decode_batch(lens: tuple[int, ...] = (5, 3), page_size: int = 4) -> AttnBatch:
    tables = [[2 * i, 2 * i + 1] for i in range(len(lens))]
    return AttnBatch.build(
        Phase.DECODE,
        q_lens=[1] * len(lens),
        kv_lens=list(lens),
        page_tables=tables,
        page_size=page_size,
    )


def tensors(c: AttnConfig, tokens: int, pages: int = 8) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, c.num_q_heads, c.head_dim, generator=g)
    k = torch.randn(pages, c.page_size, c.num_kv_heads, c.head_dim, generator=g)
    v = torch.randn(pages, c.page_size, c.num_kv_heads, c.head_dim, generator=g)
    return q, k, v


# -- 1. plans that cannot be forged ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
def test_replaced_plan_is_refused(backend: str) -> None:
    # Before: the owner field was copied by dataclasses.replace, so a plan with another
    # plan's snapshot (fewer tokens) or native handle passed the owner check.
    c = cfg()
    binding = bind(backend, c)
    big, small = decode_batch((5, 3)), decode_batch((2,))
    plan = binding.plan(big)
    other = binding.plan(small)
    run = binding.handler(Phase.DECODE)
    q, k, v = tensors(c, 2)
    assert run(q, k, v, plan, 0.25).shape == (2, 4, 16)
    snap_field = "snapshot" if backend == "native" else "snap"
    forged = [
        dataclasses.replace(plan),
        dataclasses.replace(plan, **{snap_field: getattr(other, snap_field)}),
    ]
    if backend == "native":
        forged.append(dataclasses.replace(plan, num_tokens=other.num_tokens))
    for bad in forged:
        with pytest.raises(InvalidBatchError, match="copy of a plan") as err:
            run(q, k, v, bad, 0.25)
        assert err.value.field == "plan"
        with pytest.raises(InvalidBatchError, match="copy of a plan"):
            binding.backend(Phase.DECODE).handler(Phase.DECODE)(q, k, v, bad, 0.25)


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
def test_copy_and_deepcopy_of_a_plan_are_our_error(backend: str) -> None:
    # Before: copy.deepcopy of a native plan raised ValueError (a ctypes pointer).
    plan = bind(backend, cfg()).plan(decode_batch())
    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(InvalidBatchError, match="cannot be copied") as err:
            copier(plan)
        assert err.value.field == "plan"


def test_plan_of_another_binding_same_backend_refused() -> None:
    c = cfg()
    a, b = bind("torch", c), bind("torch", c)
    plan_b = b.plan(decode_batch())
    q, k, v = tensors(c, 2)
    with pytest.raises(InvalidBatchError, match="another TorchBackend") as err:
        a.handler(Phase.DECODE)(q, k, v, plan_b, 0.25)
    assert err.value.field == "plan"


TRITON_SCRIPT = """
import dataclasses, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
from attn_dispatch.backends.triton.backend import TritonBackend

c = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
               page_size=4)
be = TritonBackend(c)
batch = AttnBatch.build(Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 3],
                        page_tables=[[0, 1], [2, 3]], page_size=4)
plan = be.plan(batch)
small = be.plan(AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[2], page_tables=[[0]],
                                page_size=4))
run = be.handler(Phase.DECODE)
q = torch.randn(2, 4, 16); k = torch.randn(8, 4, 2, 16); v = torch.randn(8, 4, 2, 16)
run(q, k, v, plan, 0.25)
outcomes = []
for bad in (dataclasses.replace(plan, num_requests=small.num_requests), dataclasses.replace(plan)):
    try:
        run(q, k, v, bad, 0.25)
        outcomes.append("ran")
    except InvalidBatchError as e:
        outcomes.append(e.field)
try:
    be.update_plan(plan, object())
    outcomes.append("ran")
except InvalidBatchError as e:
    outcomes.append(e.field)
print("OUTCOMES", outcomes)
"""


def test_triton_forged_plan_and_update_plan_of_a_non_batch() -> None:
    # Before: a replaced triton plan with a smaller snapshot wrote rows by request index
    # (segfault on CUDA); update_plan(plan, object()) raised a raw AttributeError.
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRITON_SCRIPT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OUTCOMES ['plan', 'plan', 'batch']" in proc.stdout


# -- 2. one validation of every config value and call argument -------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_left", 2**31),  # before: passed bind, failed at plan or truncated to int32
        ("window_left", 2**32),  # before: behaved as window 0 on native
        ("logit_cap", 1e-300),  # before: float32 0 -> "off" on native, a cap on torch
        ("logit_cap", 1e39),  # before: past float32: inf on the kernels
        ("logit_cap", 1e-40),  # a float32 denormal
        ("sm_scale", 1e-300),
        ("sm_scale", 1e39),
        ("sm_scale", True),
        ("page_size", 4.0),
        ("page_size", True),
        ("num_q_heads", 2**31),
        ("head_dim", 2**40),
    ],
)
def test_config_values_past_what_kernels_represent(field: str, value: object) -> None:
    with pytest.raises(InvalidSpecError) as err:
        cfg(**{field: value})
    assert err.value.field == field


def test_config_edges_that_kernels_represent() -> None:
    c = cfg(window_left=2**31 - 1, logit_cap=1e-30, sm_scale=3e38)
    assert (c.window_left, c.logit_cap, c.sm_scale) == (2**31 - 1, 1e-30, 3e38)
    assert cfg(logit_cap=0).logit_cap is None  # 0 is "off"


BAD_SCALES = [math.nan, math.inf, -1.0, 0.0, 0, True, "0.25", 1e39, 1e-300, None]


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_call_sm_scale_refused_on_every_path(bad: object) -> None:
    # Before: NaN, bool, str, 0 or negative scales went to the kernels (NaN or a raw
    # TypeError) when the config had no scale; the direct path checked nothing.
    c = cfg()
    binding = bind("torch", c)
    batch = decode_batch()
    q, k, v = tensors(c, 2)
    plan = binding.plan(batch)
    calls = {
        "attention": lambda: attention(q, k, v, sm_scale=bad),
        "direct": lambda: resolve(Phase.DECODE)(q, k, v, plan, bad),
        "handler": lambda: binding.handler(Phase.DECODE)(q, k, v, plan, bad),
    }
    from attn_dispatch.compile import attention_op

    calls["compiled op"] = lambda: attention_op(q, k, v, sm_scale=bad)
    with attn_scope(binding, batch):
        for name, call in calls.items():
            if bad is None and name == "compiled op":
                continue  # None there means "the config's", which is missing: same error below
            with pytest.raises(InvalidBatchError) as err:
                call()
            assert err.value.field == "sm_scale", name


@pytest.mark.parametrize("bad", [True, "2", math.nan, 0.0, -2.0, 1e39, 1e-300], ids=repr)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_fp8_scales_refused_on_every_path(name: str, bad: object) -> None:
    # Before: the compiled op converted True/"2" to floats the eager call refuses; 1e39 gave
    # NaN on torch and numbers on native.
    c = cfg(kv_dtype="float8_e4m3fn")
    binding = bind("torch", c)
    batch = decode_batch()
    q, k, v = tensors(c, 2)
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    plan = binding.plan(batch)
    from attn_dispatch.compile import attention_op

    with attn_scope(binding, batch):
        good = attention(q, k, v, sm_scale=0.25, k_scale=2.0, v_scale=0.5)
        assert torch.isfinite(good).all()
        for call in (
            lambda: attention(q, k, v, sm_scale=0.25, **{name: bad}),
            lambda: resolve(Phase.DECODE)(q, k, v, plan, 0.25, **{name: bad}),
            lambda: attention_op(q, k, v, sm_scale=0.25, **{name: bad}),
        ):
            with pytest.raises(InvalidBatchError) as err:
                call()
            assert err.value.field == name


def test_direct_path_applies_the_config_rules() -> None:
    # Before: resolve(phase)(...) ignored k_scale on a non-FP8 config and applied sinks on a
    # sinks=False config.
    c = cfg()
    binding = bind("torch", c)
    batch = decode_batch()
    q, k, v = tensors(c, 2)
    with attn_scope(binding, batch):
        run = resolve(Phase.DECODE)
        plan = binding.plan(batch)
        with pytest.raises(InvalidBatchError, match="not FP8") as err:
            run(q, k, v, plan, 0.25, k_scale=2.0)
        assert err.value.field == "k_scale"
        with pytest.raises(InvalidBatchError, match="sinks=False") as err:
            run(q, k, v, plan, 0.25, sinks=torch.zeros(4))
        assert err.value.field == "sinks"
    sinks_binding = bind("torch", cfg(sinks=True))
    plan = sinks_binding.plan(batch)
    run = sinks_binding.handler(Phase.DECODE)
    with pytest.raises(InvalidBatchError, match="sinks=True"):
        run(q, k, v, plan, 0.25)
    for bad, words in [
        (torch.zeros(3), r"shape \(3,\)"),
        (torch.zeros(4, dtype=torch.float64), "float32"),
        (torch.zeros(8)[::2], "contiguous"),
        ([0.0] * 4, "torch.Tensor"),
    ]:
        with pytest.raises(InvalidBatchError, match=words) as err:
            run(q, k, v, plan, 0.25, sinks=bad)
        assert err.value.field == "sinks"
    assert torch.isfinite(run(q, k, v, plan, 0.25, sinks=torch.zeros(4))).all()


def test_direct_path_with_config_scale() -> None:
    c = cfg(sm_scale=0.25)
    binding = bind("torch", c)
    batch = decode_batch()
    q, k, v = tensors(c, 2)
    run = binding.handler(Phase.DECODE)
    plan = binding.plan(batch)
    out = run(q, k, v, plan, 0.25)
    torch.testing.assert_close(run(q, k, v, plan, None), out)  # None: the config's
    for bad in (0.5, True, math.nan):
        with pytest.raises(InvalidBatchError) as err:
            run(q, k, v, plan, bad)
        assert err.value.field == "sm_scale"


# -- 3. scopes and graphs --------------------------------------------------------------------


def test_prepared_plan_of_another_binding_refused() -> None:
    # Before: attn_scope(A, batch, prepared=B.prepare(batch)) ran B's plan and kernels and
    # recorded runner A.
    a = bind("torch", cfg(), label="A")
    b = bind("torch", cfg(), label="B")
    batch = decode_batch()
    with pytest.raises(UsageError, match="not one runner 'A' serves") as err:
        attn_scope(a, batch, prepared=b.prepare(batch))
    assert err.value.api == "attn_scope(prepared=...)"  # misuse of the API, not a bad batch
    q, k, v = tensors(a.config, 2)
    with attn_scope(a, batch, prepared=a.prepare(batch)):  # its own: fine
        assert attention(q, k, v, sm_scale=0.25).shape == (2, 4, 16)


def test_graph_replay_refuses_another_page_size() -> None:
    # Before: with max_pages_per_request the replayed batch was relabelled with the captured
    # page size, so a batch of page size 8 replayed on a graph captured for 4.
    from attn_dispatch.cuda_graph import GraphedForward

    c = cfg()
    binding = bind("torch", c)
    q, k, v = tensors(c, 2)

    def step(q: Any, k: Any, v: Any) -> Any:
        return attention(q, k, v, sm_scale=0.25)

    graphed = GraphedForward(binding, decode_batch(), step, q, k, v, max_pages_per_request=2)
    graphed.replay(decode_batch((6, 4)), q)
    other = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 3], page_tables=[[0], [1]], page_size=8
    )
    with pytest.raises(InvalidBatchError) as err:
        graphed.replay(other, q)
    assert err.value.field == "page_size"


@pytest.mark.parametrize("bad", [True, 1.5, 0, -1])
def test_graph_capacity_must_be_a_positive_int(bad: object) -> None:
    # Before: max_pages_per_request=True was accepted (a bool is an int).
    from attn_dispatch.cuda_graph import GraphedForward

    c = cfg()
    q, k, v = tensors(c, 2)
    with pytest.raises(InvalidBatchError) as err:
        GraphedForward(bind("torch", c), decode_batch(), lambda *a: None, q, k, v,
                       max_pages_per_request=bad)  # fmt: skip
    assert err.value.field == "max_pages_per_request"


class _SlowPlanBackend(BackendBase):
    """Its plan() blocks in the first thread until the second one has tried to enter."""

    name = "slow"
    first: threading.Thread | None = None
    started = threading.Event()
    release = threading.Event()

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        self.config = config

    def plan(self, batch: Any) -> Any:
        if threading.current_thread() is _SlowPlanBackend.first:
            _SlowPlanBackend.started.set()
            assert _SlowPlanBackend.release.wait(TIMEOUT)
        return ("plan", batch.phase)

    def handler(self, phase: Phase) -> Any:
        return lambda q, k, v, plan, s: plan


def test_one_scope_instance_entered_by_two_threads_admits_one() -> None:
    # Before: the "already active" test and the entry were apart (planning in between), so
    # both threads got in, and the first one stayed bound after its `with` (its token was
    # overwritten by the second's).
    reg = Registry(builtins=False, plugins=False)
    reg.register("slow", capabilities=Capabilities(kinds={"mha"}), factory=_SlowPlanBackend)
    binding = bind("slow", cfg(), registry=reg, label="shared")
    scope = attn_scope(binding, decode_batch())
    results: dict[str, Any] = {}

    def first() -> None:
        try:
            with scope:
                results["first_in"] = current_binding() is binding
        except ScopeError as exc:
            results["first_in"] = exc
        results["first_after"] = _bound()

    def second() -> None:
        assert _SlowPlanBackend.started.wait(TIMEOUT)
        try:
            with scope:
                results["second_in"] = True
        except ScopeError as exc:
            results["second_in"] = exc
        finally:
            _SlowPlanBackend.release.set()
        results["second_after"] = _bound()

    t1 = threading.Thread(target=first)
    t2 = threading.Thread(target=second)
    _SlowPlanBackend.first = t1
    t1.start()
    t2.start()
    t1.join(TIMEOUT * 2)
    t2.join(TIMEOUT * 2)
    assert not t1.is_alive() and not t2.is_alive(), "a thread hung"
    assert results["first_in"] is True
    assert isinstance(results["second_in"], ScopeError)
    assert "another thread" in str(results["second_in"])
    assert results["first_after"] is False and results["second_after"] is False
    with scope:  # free again once its owner left
        assert current_binding() is binding


def _bound() -> bool:
    try:
        current_binding()
    except NoActiveScopeError:
        return False
    return True


# -- 4. raw errors become ours ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kv_lens": [2**31, 3]}, "kv_lens"),  # before: RuntimeError from torch.tensor
        ({"page_tables": [[2**31, 1], [2, 3]]}, "page_tables"),  # before: RuntimeError
        ({"page_size": 4.0}, "page_size"),  # before: AssertionError
        ({"page_size": True}, "page_size"),
        ({"q_lens": [1.5, 1]}, "q_lens"),  # before: silently truncated to 1
        ({"kv_lens": [5.0, 3]}, "kv_lens"),
        ({"num_pages": 8.0}, "num_pages"),
        ({"q_lens": [-1, 1]}, "q_lens"),
    ],
)
def test_build_refuses_values_with_our_error(changes: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = dict(
        q_lens=[1, 1], kv_lens=[5, 3], page_tables=[[0, 1], [2, 3]], page_size=4
    )
    args.update(changes)
    with pytest.raises(InvalidBatchError) as err:
        AttnBatch.build(Phase.DECODE, **args)
    assert err.value.field == field


def test_build_accepts_integer_scalars() -> None:
    lens = [torch.tensor(5), torch.tensor(3)]
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=lens, page_tables=[[0, 1], [2, 3]], page_size=4
    )
    assert batch.kv_lens.tolist() == [5, 3]


def test_batch_page_size_field_checked() -> None:
    b = decode_batch()
    with pytest.raises(InvalidBatchError) as err:
        AttnBatch(Phase.DECODE, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_lens, page_size=2.5)
    assert err.value.field == "page_size"


# -- issue 21: handler signatures checked at bind ---------------------------------------------


class _NoKeywords(BackendBase):
    name = "nokw"

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        self.config = config

    def plan(self, batch: Any) -> Any:
        return batch

    def handler(self, phase: Phase) -> Any:
        def run(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> Any:
            return q

        return run


@pytest.mark.parametrize(
    ("changes", "keyword"),
    [({"sinks": True}, "sinks="), ({"kv_dtype": "float8_e5m2"}, "k_scale=")],
)
def test_handler_without_declared_keyword_refused_at_bind(
    changes: dict[str, Any], keyword: str
) -> None:
    # Before: bound fine, then a raw TypeError on the first call.
    reg = Registry(builtins=False, plugins=False)
    caps = Capabilities(
        kinds={"mha"},
        kv_dtypes={"float32", "float8_e5m2"},
        variants={"sinks"},
    )
    reg.register("nokw", capabilities=caps, factory=_NoKeywords)
    with pytest.raises(BackendUnavailableError, match=keyword) as err:
        bind("nokw", cfg(**changes), registry=reg)
    assert "nokw" in str(err.value)
    bind("nokw", cfg(), registry=reg)  # a config without them binds


# -- issue 21: the core imports on every supported Python -------------------------------------


def _pyenv_pythons() -> list[str]:
    import glob

    try:
        root = subprocess.run(
            ["pyenv", "root"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for minor in ("3.10", "3.13"):
        found.extend(sorted(glob.glob(f"{root}/versions/{minor}.*/bin/python{minor}"))[-1:])
    return found


CORE_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import attn_dispatch as ad
from attn_dispatch import AttnConfig, Phase, attention, attn_scope, bind, resolve
from attn_dispatch.backend import BackendBase, Capabilities, Registry
class Batch:
    phase = Phase.DECODE
class Echo(BackendBase):
    name = "echo"
    def __init__(self, config, **options): pass
    def plan(self, batch): return "plan"
    def handler(self, phase): return lambda q, k, v, plan, s: (q, plan, s)
reg = Registry(builtins=False, plugins=False)
reg.register("echo", capabilities=Capabilities(kinds={{"mha"}}), factory=Echo)
cfg = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
binding = bind("echo", cfg, registry=reg)
with attn_scope(binding, Batch()):
    assert attention("q", "k", "v", sm_scale=0.5) == ("q", "plan", 0.5)
    assert resolve(Phase.DECODE)("q", "k", "v", "p", 0.25) == ("q", "p", 0.25)
assert "torch" not in sys.modules
from attn_dispatch.integrations.sglang import phase_of
print("OK", sys.version_info[:2], phase_of("DECODE"), ad.__version__)
"""


@pytest.mark.parametrize("python", _pyenv_pythons() or [None])
def test_core_imports_on_python_310_and_313(python: str | None) -> None:
    # Before: typing.Unpack (3.11+) at import broke `import attn_dispatch` on Python 3.10.
    if python is None:
        pytest.skip("no pyenv interpreters for 3.10 / 3.13 on this machine")
    proc = subprocess.run(
        [python, "-c", CORE_SCRIPT.format(root=ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout and "Phase.DECODE" in proc.stdout


# -- issue 21: a grouped binding's configs, and bind/explain's shared check -------------------


def test_grouped_binding_config_is_per_group() -> None:
    # Before: binding.config of a grouped binding was the first group's config.
    sliding, full = cfg(window_left=7), cfg()
    binding = bind("torch", {"sliding": sliding, "full": full})
    assert dict(binding.configs) == {"sliding": sliding, "full": full}
    assert binding.groups["full"].config is full
    with pytest.raises(UsageError, match=r"binding\.configs\[name\]") as err:
        _ = binding.config
    assert err.value.api == "Binding.config"
    plain = bind("torch", full)
    assert plain.config is full and dict(plain.configs) == {}
    route = plain.route(Phase.DECODE)
    assert route.name == "torch" and route.handler is plain.handler(Phase.DECODE)
    assert route.raw == plain.backend(Phase.DECODE).handler(Phase.DECODE)  # the bound method


def test_check_machine_false_gives_config_reasons_only() -> None:
    from attn_dispatch._binding import check_spec

    reg = Registry(builtins=False, plugins=False)
    caps = Capabilities(kinds={"mha"}, requires=("attn_dispatch_no_such_module",))
    reg.register("absent", capabilities=caps, factory=_NoKeywords)
    config_only: dict[Phase, tuple[str, list[str]]] = {}
    check_spec("absent", cfg(), registry=reg, reasons=config_only, machine=False)
    assert config_only == {}  # nothing in the config is refused
    everything: dict[Phase, tuple[str, list[str]]] = {}
    check_spec("absent", cfg(), registry=reg, reasons=everything)
    assert set(everything) == set(Phase)
    assert all("attn_dispatch_no_such_module" in " ".join(w) for _, w in everything.values())
    refused: dict[Phase, tuple[str, list[str]]] = {}
    check_spec("absent", cfg(kind="mla", num_kv_heads=1, head_dim=576, v_head_dim=512),
               registry=reg, reasons=refused, machine=False)  # fmt: skip
    assert set(refused) == set(Phase)
    assert all("'mla'" in " ".join(w) for _, w in refused.values())
