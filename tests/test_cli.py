"""The CLI: `list` and `explain`, exit codes 0 (ok), 1 (incompatible), 2 (bad input)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attn_dispatch._cli import main
from tests.strategies import MHA_ONLY_CAPS
from tests.strategies import register_echo

pytestmark = pytest.mark.usefixtures("registry_snapshot")

MLA_ARGS = [
    "--kind",
    "mla",
    "--heads",
    "16",
    "--head-dim",
    "576",
    "--v-head-dim",
    "512",
    "--dtype",
    "bfloat16",
    "--device",
    "cpu",
]


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    register_echo("mhaonly", MHA_ONLY_CAPS)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["backend", "kinds", "phases", "devices", "dtypes", "available"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["torch"][1:6] == [
        "mha,mla",
        "decode,prefill,verify",
        "cpu,cuda",
        "bfloat16,float16,float32",
        "yes",
    ]
    assert rows["mhaonly"][1:3] == ["mha", "decode,prefill,verify"]


def test_list_shows_why_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_dispatch import Capabilities

    register_echo(
        "needs",
        Capabilities(
            requires=("no_such_mod_cli",), availability=(lambda: ["not built: run make"],)
        ),
    )
    assert main(["list"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("needs ")]
    assert "no: module 'no_such_mod_cli' is not installed" in row
    assert "; not built: run make" in row


def test_explain_ok(capsys: pytest.CaptureFixture[str]) -> None:
    register_echo("ea")
    assert main(["explain", "--spec", "prefill=torch,decode=ea", *MLA_ARGS]) == 0
    out = capsys.readouterr().out
    assert "kind='mla'" in out and "num_kv_heads=1" in out  # MLA defaults to one KV head
    assert "spec:   prefill=torch,decode=ea" in out
    table = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["prefill"], ["decode"], ["verify"])
    ]
    assert table == [
        ["prefill", "torch", "ok", "ok"],
        ["decode", "ea", "ok", "ok"],
        ["verify", "torch", "ok", "ok"],
        # after a real bind on this machine:
        ["prefill", "torch"],
        ["decode", "ea"],
        ["verify", "torch"],
    ]
    assert "binds on this machine:" in out


def test_explain_incompatible(capsys: pytest.CaptureFixture[str]) -> None:
    register_echo("mhaonly", MHA_ONLY_CAPS)
    code = main(
        ["explain", "--spec", "prefill=torch,decode=mhaonly", "--label", "target", *MLA_ARGS]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "from the config (hold on every machine):" in out
    assert "  - decode -> 'mhaonly': kind 'mla' is not supported (supported: 'mha')" in out
    assert "prefill ->" not in out
    assert "from this machine" not in out  # nothing here is the machine's fault
    assert "binds on this machine" not in out


def _cuda_backend(name: str) -> None:
    from attn_dispatch import Capabilities

    register_echo(
        name,
        Capabilities(
            kinds={"mla"},
            devices={"cuda"},
            dtypes={"bfloat16"},
            requires=("no_such_gpu_lib_cli",),
            min_compute_capability=(9, 0),
            forms={"mla"},
        ),
    )


CUDA_ARGS = [a if a != "cpu" else "cuda" for a in MLA_ARGS]


def test_explain_static_for_another_machine(capsys: pytest.CaptureFixture[str]) -> None:
    # A config for a GPU server, checked on this (CPU) machine: the missing module and CUDA
    # are this machine's reasons, listed apart; the config itself is servable, so exit 0.
    _cuda_backend("gpuonly")
    assert main(["explain", "--spec", "gpuonly", "--static", *CUDA_ARGS]) == 0
    out = capsys.readouterr().out
    assert "from the config" not in out
    machine = out.split("from this machine's runtime (modules, CUDA, compute capability):")[1]
    assert "module 'no_such_gpu_lib_cli' is not installed" in machine
    assert "can be served by these backends on a machine that has what they need" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("decode ")]
    assert rows == [["decode", "gpuonly", "ok", "no", "(2)"]] or rows[0][2] == "ok"
    # Without --static the same check fails here (exit 1) and says why, without building.
    assert main(["explain", "--spec", "gpuonly", *CUDA_ARGS]) == 1
    assert "binds on this machine" not in capsys.readouterr().out


def test_explain_static_still_refuses_what_the_config_asks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _cuda_backend("gpuonly2")
    args = [a if a != "bfloat16" else "float16" for a in CUDA_ARGS]
    assert main(["explain", "--spec", "gpuonly2", "--static", *args]) == 1
    out = capsys.readouterr().out
    cfg = out.split("from the config (hold on every machine):")[1].split("from this machine")[0]
    assert "dtype 'float16' is not supported (supported: 'bfloat16')" in cfg
    assert "not installed" not in cfg  # the machine's reasons stay in their own list
    assert "cannot be served by these backends" in out


def test_explain_static_checks_mla_form_policies(capsys: pytest.CaptureFixture[str]) -> None:
    # The native backend is CPU-only; its form policy may choose the decompressed 'mha' form,
    # whose config (192/128) is checked statically too.
    args = [*CUDA_ARGS, "--mha-head-dim", "192", "--mha-v-head-dim", "128"]
    assert main(["explain", "--spec", "native", "--static", *args]) == 1
    out = capsys.readouterr().out
    assert "prefill -> 'native': decompressed form 'mha' (192/128): device 'cuda'" in out


def test_explain_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--spec", "tourch", *MLA_ARGS]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "unknown attention backend 'tourch'" in err and "Did you mean 'torch'" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["explain", "--spec", "a,,b", *MLA_ARGS], "empty item"),
        (
            [
                "explain",
                "--spec",
                "torch",
                "--kind",
                "mha",
                "--heads",
                "6",
                "--kv-heads",
                "4",
                "--head-dim",
                "64",
            ],
            "multiple of num_kv_heads",
        ),
        (
            ["explain", "--spec", "torch", "--kind", "mla", "--heads", "16", "--head-dim", "576"],
            "v_head_dim",
        ),
        (["explain", "--spec", "torch", *MLA_ARGS, "--dtype", "int4"], "unknown dtype"),
    ],
)
def test_explain_bad_values_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["explain"],
        ["explain", "--spec", "torch", "--kind", "gqa", "--heads", "1", "--head-dim", "64"],
        ["explain", "--spec", "torch", "--kind", "mha", "--heads", "many", "--head-dim", "64"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "usage: python -m attn_dispatch" in capsys.readouterr().err


def test_module_entry_point_subprocess() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "attn_dispatch", *a],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    ok = run("explain", "--spec", "torch", *MLA_ARGS)
    assert ok.returncode == 0, ok.stderr
    assert "verify   torch" in ok.stdout
    bad = run("explain", "--spec", "torch", "--kind", "mla")
    assert bad.returncode == 2 and "required" in bad.stderr
    unknown = run("explain", "--spec", "nope", *MLA_ARGS)
    assert unknown.returncode == 2 and "unknown attention backend 'nope'" in unknown.stderr
