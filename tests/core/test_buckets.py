"""Shape buckets: a phase maps q-length or context ranges to backends. The spec value parses,
prints and round-trips; bind checks and builds every bucket's backend; attn_scope picks the
bucket once per forward (never per layer); tune emits buckets only past the measured noise."""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

import pytest

from attn_dispatch import BackendSpec
from attn_dispatch import Buckets
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UnknownBackendError
from attn_dispatch import UsageError
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import check
from attn_dispatch import current_binding
from attn_dispatch import record_dispatch
from attn_dispatch import resolve
from attn_dispatch.backend import Capabilities
from attn_dispatch.tune import PhaseTiming
from attn_dispatch.tune import TuneSizes
from attn_dispatch.tune import decide
from tests.strategies import mha_config
from tests.strategies import register_echo

SPEC = "prefill=q_len<=256:qa|q_len<=2048:qb|qc,decode=context<=512:qb|qa"


@dataclasses.dataclass
class ShapedBatch:
    """A torch-free batch with the two measures buckets read; counts how often they are read."""

    phase: Phase
    max_q_len: int = 1
    max_kv_len: int = 1
    reads: int = 0

    def __getattribute__(self, name: str) -> Any:
        if name in ("max_q_len", "max_kv_len"):
            object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
        return object.__getattribute__(self, name)


@pytest.fixture
def echoes(registry_snapshot: object) -> None:
    for name in ("qa", "qb", "qc"):
        register_echo(name)


# -- the value ---------------------------------------------------------------------------------


def test_parse_str_dict_json_pickle_round_trip() -> None:
    spec = BackendSpec.parse(SPEC)
    assert spec.prefill == "qc" and spec.decode == "qa"  # the catch-alls
    assert spec.buckets == (
        Buckets("prefill", "q_len", ((256, "qa"), (2048, "qb"))),
        Buckets("decode", "context", ((512, "qb"),)),
    )
    assert str(spec) == SPEC
    assert BackendSpec.parse(str(spec)) == spec
    assert BackendSpec.from_dict(spec.to_dict()) == spec
    assert BackendSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["buckets"]["prefill"] == {
        "measure": "q_len",
        "limits": [[256, "qa"], [2048, "qb"]],
    }
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(BackendSpec.parse(SPEC))
    assert spec != BackendSpec.parse("prefill=qc,decode=qa")
    assert spec.all_names == ("qc", "qa", "qb")


def test_which_backend_serves_which_size() -> None:
    spec = BackendSpec.parse(SPEC)
    assert [spec.backend_at(Phase.PREFILL, n) for n in (1, 256, 257, 2048, 2049)] == [
        "qa", "qa", "qb", "qb", "qc",
    ]  # fmt: skip
    assert [spec.backend_at(Phase.DECODE, n) for n in (512, 513)] == ["qb", "qa"]
    # verify=None follows verify_mode's phase, buckets included
    assert spec.buckets_for(Phase.VERIFY) == spec.buckets_for(Phase.PREFILL)
    assert spec.backend_at(Phase.VERIFY, 100) == "qa"
    own = BackendSpec.parse("prefill=q_len<=8:qa|qb,decode=qa,verify=qc")
    assert own.buckets_for(Phase.VERIFY) is None and own.backend_at(Phase.VERIFY, 1) == "qc"
    plain = spec.bucket_spec(Phase.PREFILL, 1)
    assert (plain.prefill, plain.decode, plain.buckets) == ("qb", "qa", ())
    assert spec.bucket_spec(Phase.PREFILL, 2).prefill == "qc"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prefill=q_len<=256:qa|q_len<=256:qb|qc,decode=qa", "overlaps"),
        ("prefill=q_len<=256:qa|q_len<=100:qb|qc,decode=qa", "out of order"),
        ("prefill=|qc,decode=qa", "catch-all backend"),
        ("prefill=q_len<=8:qa|,decode=qa", "catch-all backend"),
        ("prefill=q_len<=8:qa|qb|qc,decode=qa", "MEASURE<=BOUND:BACKEND"),
        ("prefill=tokens<=8:qa|qb,decode=qa", "MEASURE<=BOUND:BACKEND"),
        ("prefill=q_len<=8:qa|context<=9:qb|qc,decode=qa", "one measure per phase"),
        ("prefill=q_len<=x:qa|qb,decode=qa", "integer"),
        ("prefill=q_len<=0:qa|qb,decode=qa", ">= 1"),
        ("prefill=q_len<=8:qa|qb<=9,decode=qa", "catch-all"),
        ("prefill=q_len<=8:|qb,decode=qa", "non-empty backend name"),
    ],
)
def test_bad_buckets_are_refused_with_our_error(text: str, says: str) -> None:
    with pytest.raises(InvalidSpecError, match=says) as info:
        BackendSpec.parse(text)
    assert isinstance(info.value, ValueError)


def test_bad_values_are_refused() -> None:
    with pytest.raises(InvalidSpecError, match="one Buckets per phase"):
        BackendSpec("a", "b", buckets=(Buckets("prefill", "q_len", ((1, "x"),)),) * 2)
    with pytest.raises(InvalidSpecError, match="verify catch-all"):
        BackendSpec("a", "b", buckets=(Buckets("verify", "q_len", ((1, "x"),)),))
    with pytest.raises(InvalidSpecError, match="Buckets values"):
        BackendSpec("a", "b", buckets=("q_len<=1:x",))  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match="unknown phase"):
        Buckets("mixed", "q_len", ((1, "x"),))
    with pytest.raises(InvalidSpecError, match="at least one"):
        Buckets("prefill", "q_len", ())
    with pytest.raises(InvalidSpecError, match="bound must be an int"):
        Buckets("prefill", "q_len", ((True, "x"),))
    with pytest.raises(InvalidSpecError, match="expected"):
        BackendSpec.from_dict({"prefill": "a", "decode": "b", "buckets": {"prefill": [1]}})


# -- bind --------------------------------------------------------------------------------------


def test_bind_refuses_every_bucket_backend_that_cannot_serve(registry_snapshot: object) -> None:
    register_echo("qa")
    register_echo("gpu_only", Capabilities(kinds={"mha"}, devices={"cuda"}))
    register_echo("mla_only", Capabilities(kinds={"mla"}, devices={"cpu"}))
    spec = "prefill=q_len<=8:gpu_only|q_len<=64:mla_only|qa,decode=context<=9:gpu_only|qa"
    with pytest.raises(IncompatibleBackendError) as info:
        bind(spec, mha_config(), label="t")
    text = str(info.value)
    for line in (
        "prefill -> 'gpu_only': bucket q_len<=8: device 'cpu'",
        "prefill -> 'gpu_only': bucket q_len<=64 (backend 'mla_only'): kind 'mha'",
        "decode -> 'gpu_only': bucket context<=9: device 'cpu'",
        "verify -> 'gpu_only': bucket q_len<=8",  # verify follows prefill, buckets too
    ):
        assert line in text, text
    found = check(spec, mha_config(), machine=False)
    assert set(found) == set(Phase)


def test_an_unknown_backend_in_a_bucket_is_named(echoes: None) -> None:
    with pytest.raises(UnknownBackendError, match="'nope'"):
        bind("prefill=q_len<=8:nope|qa,decode=qa", mha_config())


def test_options_may_name_a_bucket_only_backend(echoes: None) -> None:
    binding = bind("prefill=q_len<=8:qb|qa,decode=qa", mha_config(), options={"qb": {"flag": 1}})
    assert binding.backends["qb"].options == {"flag": 1}  # type: ignore[attr-defined]
    with pytest.raises(InvalidSpecError, match="does not use"):
        bind("prefill=q_len<=8:qb|qa,decode=qa", mha_config(), options={"qc": {}})


def test_every_bucket_backend_is_built_once_at_bind(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    assert sorted(binding.backends) == ["qa", "qb", "qc"]
    ids = {b.instance for b in binding.backends.values()}  # type: ignore[attr-defined]
    for n in (8, 300, 5000):
        sub = binding.for_batch(ShapedBatch(Phase.PREFILL, max_q_len=n))
        assert {b.instance for b in sub.backends.values()} <= ids  # type: ignore[attr-defined]
        assert sub.label == "t" and not sub.bucketed
    assert binding.table() == [
        ("prefill", "q_len<=256:qa|q_len<=2048:qb|qc"),
        ("decode", "context<=512:qb|qa"),
        ("verify", "q_len<=256:qa|q_len<=2048:qb|qc"),
    ]
    with pytest.raises(UsageError, match="picks its backend by the batch's shape"):
        binding.handler(Phase.PREFILL)


# -- the scope ---------------------------------------------------------------------------------

LAYERS = 12


def forward(binding: Any, batch: ShapedBatch) -> tuple[set[str], int]:
    """One forward of LAYERS layers: which backends ran, and how often the shape was read
    after the scope opened."""
    ran = set()
    with attn_scope(binding, batch):
        opened = batch.reads
        for _ in range(LAYERS):
            ran.add(attention(None, None, None, sm_scale=0.5)[0])
            ran.add(resolve(batch.phase)(None, None, None, None, 0.5)[0])
        after = batch.reads
    return ran, after - opened


def test_the_bucket_is_resolved_once_per_forward_not_per_layer(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    batch = ShapedBatch(Phase.PREFILL, max_q_len=100)
    ran, during = forward(binding, batch)
    assert ran == {"qa"}
    assert during == 0  # no layer read the shape again
    assert batch.reads == 1  # read once, at scope entry


def test_successive_forwards_pick_their_own_bucket(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    picks = [
        forward(binding, ShapedBatch(Phase.PREFILL, max_q_len=n))[0] for n in (16, 1000, 4096, 16)
    ]
    assert picks == [{"qa"}, {"qb"}, {"qc"}, {"qa"}]
    assert forward(binding, ShapedBatch(Phase.DECODE, max_kv_len=100))[0] == {"qb"}
    assert forward(binding, ShapedBatch(Phase.DECODE, max_kv_len=600))[0] == {"qa"}
    assert forward(binding, ShapedBatch(Phase.VERIFY, max_q_len=4))[0] == {"qa"}


def test_current_binding_and_the_record_name_the_buckets_backend(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    with record_dispatch() as rec:
        with attn_scope(binding, ShapedBatch(Phase.PREFILL, max_q_len=1000)) as got:
            assert (
                current_binding()
                is got
                is binding.for_batch(ShapedBatch(Phase.PREFILL, max_q_len=1000))
            )
            assert got.backend_name(Phase.PREFILL) == "qb"
            attention(None, None, None, sm_scale=0.5)
    assert [(e.label, e.backend) for e in rec.events] == [("t", "qb")]


def test_nested_and_other_runners_are_unaffected(echoes: None) -> None:
    bucketed = bind(SPEC, mha_config(), label="t")
    plain = bind("qc", mha_config(), label="p")
    with attn_scope(bucketed, ShapedBatch(Phase.PREFILL, max_q_len=10)):
        assert attention(None, None, None, sm_scale=0.5)[0] == "qa"
        with attn_scope(plain, ShapedBatch(Phase.PREFILL, max_q_len=10)):
            assert attention(None, None, None, sm_scale=0.5)[0] == "qc"
            with attn_scope(bucketed, ShapedBatch(Phase.PREFILL, max_q_len=3000)):
                assert attention(None, None, None, sm_scale=0.5)[0] == "qc"
            assert attention(None, None, None, sm_scale=0.5)[0] == "qc"
        assert attention(None, None, None, sm_scale=0.5)[0] == "qa"
    assert plain.handler(Phase.PREFILL)(None, None, None, None, 0.5)[0] == "qc"


def test_prepared_plans_and_groups(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    batch = ShapedBatch(Phase.PREFILL, max_q_len=1000)
    prepared = binding.prepare(batch)
    assert prepared[1](None, None, None, None, 0.5)[0] == "qb"
    with attn_scope(binding, batch, prepared):
        assert attention(None, None, None, sm_scale=0.5)[0] == "qb"
    other = binding.prepare(ShapedBatch(Phase.PREFILL, max_q_len=10))
    with pytest.raises(UsageError, match="prepared handler"):
        attn_scope(binding, batch, other)  # a plan of another bucket is refused
    grouped = bind(SPEC, {"a": mha_config(), "b": mha_config()}, label="g")
    with attn_scope(grouped, ShapedBatch(Phase.PREFILL, max_q_len=5000)):
        assert attention(None, None, None, sm_scale=0.5, group="a")[0] == "qc"


def test_without_the_batch_a_bucketed_phase_has_no_handler(echoes: None) -> None:
    binding = bind(SPEC, mha_config(), label="t")
    with attn_scope(binding):
        with pytest.raises(UsageError, match="open the scope with the batch"):
            resolve(Phase.PREFILL)
    with pytest.raises(InvalidBatchError, match="max_q_len"):
        attn_scope(binding, type("B", (), {"phase": Phase.PREFILL})())


# -- tune's decision ---------------------------------------------------------------------------


def cell(backend: str, size: int, ms: float, noise_ms: float | None) -> PhaseTiming:
    return PhaseTiming(
        "",
        "prefill",
        backend,
        ms / 1e3,
        0.0,
        size=size,
        noise_s=None if noise_ms is None else noise_ms / 1e3,
    )


SIZES = TuneSizes(prefill_len=512, prefill_lens=(128, 2048))


def test_buckets_where_the_winner_changes_by_more_than_the_noise() -> None:
    cells = [
        cell("native", 128, 10, 1), cell("sdpa", 128, 30, 2),
        cell("native", 512, 50, 2), cell("sdpa", 512, 60, 3),
        cell("native", 2048, 900, 20), cell("sdpa", 2048, 300, 10),
    ]  # fmt: skip
    got = decide("prefill", cells, SIZES)
    assert got is not None
    assert got.limits == ((1024, "native"),)  # the geometric mean of 512 and 2048
    assert got.rest == "sdpa" and got.winner == "native"
    assert got.spec_text() == "q_len<=1024:native|sdpa"


def test_no_buckets_when_a_change_is_within_the_noise() -> None:
    cells = [
        cell("native", 128, 10, 1), cell("sdpa", 128, 30, 2),
        cell("native", 512, 50, 2), cell("sdpa", 512, 60, 3),
        cell("native", 2048, 310, 40), cell("sdpa", 2048, 300, 10),  # 10 ms apart, noise 40
    ]  # fmt: skip
    got = decide("prefill", cells, SIZES)
    assert got is not None and got.limits == () and got.rest == "native"
    assert "no more than the noise" in got.why
    unmeasured = [dataclasses.replace(c, noise_s=None) for c in cells]
    unmeasured[-1] = dataclasses.replace(unmeasured[-1], call_s=0.1)
    got = decide("prefill", unmeasured, SIZES)
    assert got is not None and got.limits == ()  # no spread measured: no buckets


def test_one_winner_everywhere_is_no_buckets() -> None:
    cells = [cell("sdpa", n, 1, 0.1) for n in (128, 512, 2048)]
    got = decide("prefill", [*cells, cell("torch", 512, 9, 0.1)], SIZES)
    assert got is not None and got.limits == () and got.rest == "sdpa"


def test_explain_shows_each_phases_buckets(
    registry_snapshot: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.cli import main

    register_echo("qa")
    register_echo("gpu_bucket", Capabilities(kinds={"mha"}, requires=("no_such_lib_for_buckets",)))
    args = ["--kind", "mha", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--dtype", "float32", "--page-size", "8"]  # fmt: skip
    assert main(["explain", "--spec", "prefill=q_len<=64:qa|torch,decode=qa", *args]) == 0
    out = capsys.readouterr().out
    assert "q_len<=64:qa|torch" in out
    # A bucket's backend that cannot run here is named among this machine's reasons.
    assert main(["explain", "--spec", "prefill=q_len<=64:gpu_bucket|qa,decode=qa", *args]) == 1
    out = capsys.readouterr().out
    assert "'gpu_bucket'" in out.split("from this machine's runtime")[1]


def test_within_the_noise_the_fastest_over_all_sizes_is_chosen() -> None:
    # The main size's winner (sdpa, by less than the noise) is slowest over the range.
    cells = [
        cell("native", 128, 10, 1), cell("sdpa", 128, 50, 2),
        cell("native", 512, 61, 30), cell("sdpa", 512, 60, 30),
        cell("native", 2048, 100, 5), cell("sdpa", 2048, 400, 5),
    ]  # fmt: skip
    got = decide("prefill", cells, SIZES)
    assert got is not None and got.limits == ()
    assert got.winner == "sdpa" and got.rest == "native" and got.spec_text() == "native"
