"""Dispatch tables: tune --save writes one, spec_from_table replays it at start-up; a table of
another version, a malformed or oversized one, and a stale one (each environment field) are
refused with our errors naming what is wrong."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch import bind
from attn_dispatch.dispatch_table import FORMAT
from attn_dispatch.dispatch_table import MAX_TABLE_BYTES
from attn_dispatch.dispatch_table import VERSION
from attn_dispatch.dispatch_table import DispatchTable
from attn_dispatch.dispatch_table import DispatchTableError
from attn_dispatch.dispatch_table import StaleTableError
from attn_dispatch.dispatch_table import current_environment
from attn_dispatch.dispatch_table import spec_from_table
from attn_dispatch.dispatch_table import tune_table
from attn_dispatch.tune import TuneSizes

ROOT = Path(__file__).resolve().parents[2]
SMALL = TuneSizes(
    prefill_batch=1, prefill_len=16, decode_batch=2, context=32, draft_tokens=2, repeats=1
)
MHA = AttnConfig(
    kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", page_size=8
)
SLIDING = AttnConfig(
    kind="mha",
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dtype="float32",
    page_size=8,
    window_left=7,
)
BACKENDS = ["torch", "sdpa"]


@pytest.fixture(scope="module")
def table() -> DispatchTable:
    # Two runners: one with one kind of layer, one with two groups.
    return tune_table(
        {"target": {"": MHA}, "gemma": {"sliding": SLIDING, "full": MHA}},
        sizes=SMALL,
        backends=BACKENDS,
    )


def _write(tmp_path: Path, data: Any, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_a_table_holds_winner_runner_up_shape_and_environment(table: DispatchTable) -> None:
    data = table.data
    assert (data["format"], data["version"]) == (FORMAT, VERSION)
    env = data["environment"]
    assert env == current_environment("cpu", BACKENDS)
    assert set(env["builds"]) == set(BACKENDS) and env["builds"]["torch"].startswith("torch ")
    assert table.labels == ("gemma", "target")
    assert table.groups("gemma") == ("full", "sliding")
    for label in table.labels:
        for group in table.groups(label):
            assert table.config(label, group) == (SLIDING if group == "sliding" else MHA)
            for phase in Phase:
                c = table.choice(label, group, phase)
                assert {c.winner, c.runner_up} == set(BACKENDS)
                assert 0 < c.winner_ms <= c.runner_up_ms  # type: ignore[operator]
    decode = table.choice("target", "", Phase.DECODE).shape
    assert decode == {"batch": 2, "q_len": 1, "context": 32}
    assert table.choice("target", "", "verify").shape == {"batch": 2, "q_len": 2, "context": 34}


def test_format_round_trip(table: DispatchTable, tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    table.save(path)
    back = DispatchTable.load(path)
    assert back.data == table.data and back.fingerprint() == table.fingerprint()
    assert DispatchTable.from_json(table.to_json()).data == table.data
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]  # no temporary left


def test_replayed_spec_is_the_winners_and_binds_like_a_written_one(
    table: DispatchTable, tmp_path: Path
) -> None:
    path = tmp_path / "table.json"
    table.save(path)
    spec = spec_from_table(path, label="target")
    assert isinstance(spec, BackendSpec)
    for phase in Phase:
        assert spec.backend_for(phase) == table.choice("target", "", phase).winner
    # Provenance only: equal to the spec written by hand, so dispatch is the same.
    assert spec == BackendSpec.parse(str(spec))
    assert spec.note is not None and table.fingerprint() in spec.note
    binding = bind(spec, MHA, label="target")
    assert [binding.backend_name(p) for p in Phase] == list(spec.names)
    grouped = spec_from_table(path, label="gemma")
    assert isinstance(grouped, dict) and set(grouped) == {"sliding", "full"}
    bound = bind(grouped, {"sliding": SLIDING, "full": MHA}, label="gemma")
    assert set(bound.groups) == {"sliding", "full"}


def test_explain_names_where_each_choice_came_from(table: DispatchTable) -> None:
    text = table.explain("gemma")
    for group in ("sliding", "full"):
        for phase in ("prefill", "decode", "verify"):
            c = table.choice("gemma", group, phase)
            assert f"{group} {phase}: {c.winner} {c.winner_ms:.3f} ms" in text
    assert table.fingerprint() in text and "torch" in text


def test_label_and_group_must_exist(table: DispatchTable, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table.save(path)
    with pytest.raises(DispatchTableError, match="'gemma', 'target'") as e:
        spec_from_table(path, label="draft")
    assert e.value.field == "label"
    with pytest.raises(DispatchTableError, match="name one"):
        spec_from_table(path)  # two runners: which?
    with pytest.raises(DispatchTableError) as e:
        table.spec("gemma", "local")
    assert e.value.field == "group"
    with pytest.raises(AttnDispatchError):
        spec_from_table(path, label="target", on_stale="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [0, 3, "1", "2", 2.0, True, None])
def test_unknown_versions_are_refused(table: DispatchTable, version: Any) -> None:
    data = copy.deepcopy(dict(table.data))
    data["version"] = version
    with pytest.raises(DispatchTableError, match="reads 1 and 2") as e:
        DispatchTable.from_json(json.dumps(data))
    assert e.value.field == "version"


def _edit(table: DispatchTable, path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(dict(table.data))
    keys = path.split("/")
    at = data
    for k in keys[:-1]:
        at = at[k]
    if value is KeyError:
        del at[keys[-1]]
    else:
        at[keys[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("format", "something.else", "format"),
        ("extra", 1, "table"),
        ("environment", KeyError, "environment"),
        ("environment/threads", "2", "environment.threads"),
        ("environment/builds", {"torch": 2}, "environment.builds"),
        ("sizes/repeats", 0, "sizes"),
        ("runners", {}, "runners"),
        ("runners/target/", {"config": {"kind": "gqa"}, "phases": {}}, "runners.target..config"),
        ("runners/target//phases/prefill/winner_ms", float("nan"),
         "runners.target..phases.prefill.winner_ms"),
        ("runners/target//phases/prefill/runner_up_ms", None,
         "runners.target..phases.prefill.runner_up"),
        ("runners/target//phases/prefill/shape", {"batch": 0, "q_len": 1, "context": 1},
         "runners.target..phases.prefill.shape"),
        ("runners/target//phases/extend", {}, "runners.target..phases.extend"),
    ],
)  # fmt: skip
def test_malformed_tables_are_refused_naming_the_field(
    table: DispatchTable, path: str, value: Any, field: str
) -> None:
    with pytest.raises(DispatchTableError) as e:
        DispatchTable.from_json(json.dumps(_edit(table, path, value)))
    assert e.value.field == field
    assert isinstance(e.value, ValueError)
    assert pickle.loads(pickle.dumps(e.value)).field == field


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("not json", "json"),
        ("[1, 2]", "table"),
        ("[" * 100_000, "json"),
        ("", "json"),
        ('{"version": ' + "9" * 5000 + "}", "json"),
    ],
)
def test_text_that_is_not_a_table_is_refused(text: str, field: str) -> None:
    with pytest.raises(DispatchTableError) as e:
        DispatchTable.from_json(text)
    assert e.value.field == field


def test_a_table_made_directly_is_checked_too() -> None:
    with pytest.raises(DispatchTableError) as e:
        DispatchTable({"format": FORMAT, "version": 3})
    assert e.value.field == "version"


def test_oversized_files_are_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TABLE_BYTES + 1)  # sparse: nothing is read or written
    with pytest.raises(DispatchTableError, match="over") as e:
        DispatchTable.load(big)
    assert e.value.field == "size"
    with pytest.raises(DispatchTableError) as e:
        DispatchTable.from_json(" " * (MAX_TABLE_BYTES + 1))
    assert e.value.field == "size"
    with pytest.raises(DispatchTableError) as e:
        DispatchTable.load(tmp_path / "missing.json")
    assert e.value.field == "file"
    bad = _write(tmp_path, "", "bad.json")
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(DispatchTableError, match="UTF-8"):
        DispatchTable.load(bad)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("attn_dispatch", "0.0.1", "attn_dispatch"),
        ("torch", "2.12.0", "torch"),
        ("device", "AMD EPYC 9654", "device"),
        ("threads", 96, "threads"),
        ("builds/torch", "torch 2.12.0", "builds.torch"),
        ("builds/native", "abi 1, isa avx2", "builds.native"),
    ],
)
def test_a_stale_table_is_refused_naming_each_changed_field(
    table: DispatchTable, tmp_path: Path, key: str, value: Any, named: str
) -> None:
    edited = _edit(table, f"environment/{key}", value)
    path = _write(tmp_path, edited)
    with pytest.raises(StaleTableError) as e:
        spec_from_table(path, label="target")
    now = current_environment("cpu", list(edited["environment"]["builds"]))
    expected_now = now.get(key, "<not here>") if "/" not in key else now["builds"].get(
        key.split("/")[1], "<not here>"
    )  # fmt: skip
    assert e.value.differences == {named: (value, expected_now)}
    assert f"{named}: saved {value!r}, now {expected_now!r}" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))
    assert again.differences == e.value.differences
    assert json.loads(path.read_text()) == edited  # untouched


def test_every_changed_field_is_named_at_once(table: DispatchTable) -> None:
    now = dict(current_environment("cpu", BACKENDS))
    now.update(torch="9.9", threads=1, builds={"torch": "torch 9.9", "sdpa": "torch 9.9"})
    diffs = table.stale_fields(now)
    assert set(diffs) == {"torch", "threads", "builds.torch", "builds.sdpa"}


def test_on_stale_retune_measures_again_and_rewrites_the_file(
    table: DispatchTable, tmp_path: Path
) -> None:
    stale = _edit(table, "environment/torch", "2.12.0")
    stale = _edit(DispatchTable(stale), "runners/target//phases/decode/winner", "flashinfer")
    path = _write(tmp_path, stale)
    spec = spec_from_table(path, label="target", on_stale="retune")
    assert isinstance(spec, BackendSpec) and spec.decode in BACKENDS
    fresh = DispatchTable.load(path)
    assert fresh.stale_fields() == {}
    assert fresh.config("gemma", "sliding") == SLIDING  # every runner was measured again
    assert spec.note is not None and fresh.fingerprint() in spec.note


def test_tune_save_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "tuned.json"
    cmd = [
        sys.executable, "-m", "attn_dispatch", "tune", "--kind", "mha", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32", "--page-size", "8",
        "--prefill-len", "16", "--prefill-batch", "1", "--decode-batch", "2", "--context",
        "32", "--draft-tokens", "2", "--repeats", "1", "--backends", "torch,sdpa",
        "--label", "target", "--save", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "recommended" in run.stdout and f"saved dispatch table {out}" in run.stderr
    table = DispatchTable.load(out)
    assert table.labels == ("target",) and table.config("target", "") == MHA
    spec = spec_from_table(out)
    assert isinstance(spec, BackendSpec)
    # The spec printed as recommended is the one the table replays.
    assert f"recommended: {spec}" in run.stdout


def test_ranks_that_loaded_different_tables_disagree(table: DispatchTable, tmp_path: Path) -> None:
    from attn_dispatch.distributed import binding_summary
    from attn_dispatch.distributed import compare_summaries

    same = table.spec("target")
    other = DispatchTable(_edit(table, "environment/threads", 64)).spec("target")
    assert same == other and same.note != other.note  # same kernels, another measurement
    ranks = [binding_summary({"target": bind(s, MHA)}) for s in (same, same, other)]
    assert compare_summaries(ranks[:2]) == {}
    diffs = compare_summaries(ranks)
    assert list(diffs) == ["runner 'target'.spec.note"]
    assert table.fingerprint() in diffs["runner 'target'.spec.note"][0]


SHAPE = ["--kind", "mha", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--dtype", "float32", "--page-size", "8"]  # fmt: skip


def test_explain_replays_a_table_and_refuses_a_stale_one(
    table: DispatchTable, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.cli import main

    path = tmp_path / "t.json"
    table.save(path)
    assert main(["explain", "--table", str(path), "--label", "target", *SHAPE]) == 0
    out = capsys.readouterr().out
    spec = table.spec("target")
    assert table.explain("target").splitlines()[1] in out and f"spec:   {spec}" in out
    # The table's runner has groups; these layers have none: refused, not guessed.
    assert main(["explain", "--table", str(path), "--label", "gemma", *SHAPE]) == 2
    assert "groups ['full', 'sliding']" in capsys.readouterr().err
    stale = _write(tmp_path, _edit(table, "environment/torch", "2.12.0"), "stale.json")
    assert main(["explain", "--table", str(stale), "--label", "target", *SHAPE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dispatch table") and "torch: saved '2.12.0'" in err
    with pytest.raises(SystemExit) as e:  # neither --spec nor --table: a usage error
        main(["explain", *SHAPE])
    assert e.value.code == 2 and "--spec or --table" in capsys.readouterr().err


def test_tune_save_to_an_unwritable_place_is_our_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.cli import main

    where = tmp_path / "no" / "such" / "dir" / "t.json"
    args = ["tune", *SHAPE, "--prefill-len", "8", "--prefill-batch", "1", "--decode-batch", "1",
            "--context", "8", "--draft-tokens", "1", "--repeats", "1", "--backends", "torch",
            "--save", str(where)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: dispatch table {where}: file: cannot write it")


def test_tune_demo_save_files_each_runner_under_its_label(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.cli import main

    out = tmp_path / "demo.json"
    args = ["tune", "--demo", "tiny", "--prefill-len", "8", "--prefill-batch", "1",
            "--decode-batch", "1", "--context", "8", "--draft-tokens", "1", "--repeats", "1",
            "--backends", "torch,sdpa", "--save", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    table = DispatchTable.load(out)
    assert table.labels == ("draft", "target")
    for label in table.labels:
        assert table.groups(label) == ("",)
        assert f"recommended [{label}]: {table.spec(label)}" in printed
    assert table.config("draft", "").page_size == 1  # the draft's own config, not the target's


# -- version 1, shape buckets, and table specs in the engines' settings ----------------------


def _as_version_1(table: DispatchTable) -> dict[str, Any]:
    data = copy.deepcopy(dict(table.data))
    data["version"] = 1
    for key in ("prefill_lens", "contexts"):
        del data["sizes"][key]
    for groups in data["runners"].values():
        for entry in groups.values():
            for choice in entry["phases"].values():
                del choice["buckets"], choice["measured"], choice["choice"]
    return data


def test_a_version_1_table_is_still_read(table: DispatchTable, tmp_path: Path) -> None:
    old = _as_version_1(table)
    path = _write(tmp_path, old)
    back = DispatchTable.load(path)
    assert back.data == old  # read as it is: the fingerprint of the file is unchanged
    spec = spec_from_table(path, label="target")
    assert isinstance(spec, BackendSpec) and not spec.buckets
    assert spec == table.spec("target", "")
    assert back.choice("target", "", "decode").buckets is None
    bad = copy.deepcopy(old)
    bad["runners"]["target"][""]["phases"]["decode"]["buckets"] = None
    with pytest.raises(DispatchTableError) as e:
        DispatchTable(bad)  # version 1 has no buckets field
    assert e.value.field == "runners.target..phases.decode"


def _with_buckets(table: DispatchTable, buckets: Any, choice: Any = "sdpa") -> dict[str, Any]:
    data = _edit(table, "runners/target//phases/prefill/buckets", buckets)
    return _edit(DispatchTable(_as_valid(data)), "runners/target//phases/prefill/choice", choice)


def _as_valid(data: dict[str, Any]) -> dict[str, Any]:
    # A copy whose prefill buckets are null (valid), so _edit can set the pair in two steps.
    out = copy.deepcopy(data)
    out["runners"]["target"][""]["phases"]["prefill"]["buckets"] = None
    return out


def test_a_table_with_buckets_replays_them(table: DispatchTable, tmp_path: Path) -> None:
    b = {"measure": "q_len", "limits": [[8, "torch"]]}
    data = _with_buckets(table, None)
    data["runners"]["target"][""]["phases"]["prefill"]["buckets"] = b
    path = _write(tmp_path, data)
    spec = spec_from_table(path, label="target")
    assert isinstance(spec, BackendSpec)
    assert spec.phase_text(Phase.PREFILL) == "q_len<=8:torch|sdpa"
    assert spec.verify is not None  # verify names its own choice, not prefill's buckets
    binding = bind(spec, MHA, label="target")
    assert binding.bucketed
    text = DispatchTable.load(path).explain("target")
    assert "buckets q_len<=8:torch|sdpa" in text


@pytest.mark.parametrize(
    ("buckets", "field"),
    [
        ({"measure": "q_len", "limits": [[8, "torch"], [8, "sdpa"]]}, "buckets"),
        ({"measure": "tokens", "limits": [[8, "torch"]]}, "buckets"),
        ({"measure": "q_len", "limits": []}, "buckets"),
        ({"measure": "q_len", "limits": [[8]]}, "buckets.limits"),
        ({"measure": "q_len", "limits": [[8, "torch"]], "rest": "sdpa"}, "buckets"),
        ([1], "buckets"),
    ],
)
def test_malformed_buckets_in_a_table_are_refused(
    table: DispatchTable, buckets: Any, field: str
) -> None:
    data = _with_buckets(table, None)
    data["runners"]["target"][""]["phases"]["prefill"]["buckets"] = buckets
    with pytest.raises(DispatchTableError) as e:
        DispatchTable(data)
    assert e.value.field == f"runners.target..phases.prefill.{field}"
    data = _with_buckets(table, None, choice="")
    with pytest.raises(DispatchTableError) as e:
        DispatchTable(data)
    assert e.value.field == "runners.target..phases.prefill.choice"


def test_tune_records_every_size_it_timed() -> None:
    sizes = TuneSizes(
        prefill_batch=1, prefill_len=16, prefill_lens=(4, 32), decode_batch=2, context=32,
        draft_tokens=2, repeats=1,
    )  # fmt: skip
    made = tune_table({"target": {"": MHA}}, sizes=sizes, backends=BACKENDS)
    prefill = made.choice("target", "", "prefill")
    assert [m["size"] for m in prefill.measured] == [4, 16, 32]
    for m in prefill.measured:
        assert set(m["times"]) == set(BACKENDS)
        assert all(noise is not None for _, noise in m["times"].values())  # timed >= twice
    assert [m["size"] for m in made.choice("target", "", "decode").measured] == [32]
    assert made.data["sizes"]["prefill_lens"] == [4, 32]
    assert DispatchTable.from_json(made.to_json()).data == made.data


def test_engine_settings_take_a_table(table: DispatchTable, tmp_path: Path) -> None:
    from attn_dispatch.integrations.sglang_engine import _settings as sglang_settings
    from attn_dispatch.integrations.vllm import Settings

    path = tmp_path / "t.json"
    table.save(path)
    s = Settings.parse({"target": {"table": str(path)}})
    assert s.target == table.spec("target", "") and s.target.note is not None
    s = Settings.parse({"target": "torch", "draft": {"table": str(path), "label": "target"}})
    assert s.draft == table.spec("target", "")
    g = sglang_settings.Settings.parse(json.dumps({"target": {"table": str(path)}}))
    assert g.target == table.spec("target", "")
    with pytest.raises(DispatchTableError, match="no runner 'draft'"):
        Settings.parse({"target": "torch", "draft": {"table": str(path)}})
    with pytest.raises(AttnDispatchError, match="layer groups"):
        Settings.parse({"target": {"table": str(path), "label": "gemma"}})
    with pytest.raises(AttnDispatchError, match="unknown keys"):
        Settings.parse({"target": {"table": str(path), "labels": "x"}})
    stale = _write(tmp_path, _edit(table, "environment/torch", "2.12.0"), "stale.json")
    with pytest.raises(StaleTableError) as e:
        Settings.parse({"target": {"table": str(stale)}})
    assert set(e.value.differences) == {"torch"}


def test_transformers_use_takes_a_table(table: DispatchTable, tmp_path: Path) -> None:
    from attn_dispatch.integrations.transformers._use import table_specs

    path = tmp_path / "t.json"
    table.save(path)
    assert table_specs({"table": str(path)}, "target") == table.spec("target", "")
    grouped = table_specs({"table": str(path), "label": "gemma"}, None)
    assert grouped == {g: table.spec("gemma", g) for g in ("full", "sliding")}
    with pytest.raises(AttnDispatchError, match="'table', 'label', 'on_stale'"):
        table_specs({"table": str(path), "lable": "gemma"}, None)
    stale = _write(tmp_path, _edit(table, "environment/threads", 99), "stale.json")
    with pytest.raises(StaleTableError, match="threads"):
        table_specs({"table": str(stale)}, "target")
