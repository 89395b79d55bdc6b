"""The CLI: `list` and `explain`, exit codes 0 (ok), 1 (incompatible), 2 (bad input)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import attn_dispatch
from attn_dispatch.cli import main
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
    assert lines[0].split() == [
        "backend",
        "kinds",
        "phases",
        "devices",
        "dtypes",
        "distribution",
        "version",
        "available",
    ]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["torch"][1:8] == [
        "mha,mla",
        "decode,prefill,verify",
        "cpu,cuda",
        "bfloat16,float16,float32",
        "attn_dispatch",
        attn_dispatch.__version__,
        "yes",
    ]
    assert rows["mhaonly"][1:3] == ["mha", "decode,prefill,verify"]


def test_list_shows_why_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_dispatch.backend import Capabilities

    register_echo(
        "needs",
        Capabilities(
            kinds={"mha", "mla"},
            requires=("no_such_mod_cli",),
            availability=(lambda: ["not built: run make"],),
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
    from attn_dispatch.backend import Capabilities

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
    root = Path(__file__).resolve().parents[2]
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


# --- explain: variants, groups, whole models ---------------------------------------------------

MHA_ARGS = ["--kind", "mha", "--heads", "8", "--kv-heads", "2", "--head-dim", "64"]
MHA_ARGS += ["--dtype", "float32"]


def _configs_printed(out: str) -> dict[str, str]:
    """group -> the AttnConfig repr explain printed for it."""
    return {
        line.split("'")[1]: line.split(": ", 1)[1]
        for line in out.splitlines()
        if line.startswith("group '")
    }


def test_explain_variant_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_dispatch.backend import Capabilities

    register_echo("plain", Capabilities(kinds={"mha"}, devices={"cpu"}))
    args = [*MHA_ARGS, "--window-left", "7", "--logit-cap", "30", "--sinks"]
    assert main(["explain", "--spec", "torch", *args, "--kv-dtype", "fp8_e5m2"]) == 0
    out = capsys.readouterr().out
    assert "window_left=7, logit_cap=30.0, sinks=True" in out
    assert "kv_dtype='float8_e5m2'" in out
    assert main(["explain", "--spec", "plain", *args]) == 1
    out = capsys.readouterr().out
    for variant in ("'window' (window_left=7)", "'logit_cap' (logit_cap=30.0)", "'sinks'"):
        assert f"prefill -> 'plain': layer variant {variant}" in out, out
    assert "variant 'sinks' is served in phase 'decode' by: " in out and "'torch'" in out


def test_explain_groups_with_a_spec_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_dispatch.backend import Capabilities

    register_echo("nowindow", Capabilities(kinds={"mha"}, devices={"cpu"}))
    groups = ["--group", "sliding:window_left=15,kv_dtype=fp8", "--group", "full"]
    ok = ["--spec", "sliding:torch", "--spec", "full:nowindow"]
    assert main(["explain", *MHA_ARGS, *groups, *ok]) == 0
    out = capsys.readouterr().out
    configs = _configs_printed(out)
    assert "window_left=15, " in configs["sliding"]
    assert "kv_dtype='float8_e4m3fn'" in configs["sliding"]
    assert "window_left=None" in configs["full"] and "kv_dtype='float32'" in configs["full"]
    assert "spec:   sliding: torch; full: nowindow" in out
    bound = out.split("binds on this machine:")[1].splitlines()
    assert "sliding  decode   torch" in bound and "full     verify   nowindow" in bound
    # The same spec for both: the window group is refused, the full group is not.
    assert main(["explain", *MHA_ARGS, *groups, "--spec", "nowindow"]) == 1
    out = capsys.readouterr().out
    assert "[sliding] prefill -> 'nowindow': layer variant 'window'" in out
    assert "[full]" not in out.split("from the config (hold")[1]
    rows = [line.split() for line in out.splitlines() if line.startswith(("sliding ", "full "))]
    # window and FP8 refused, each with the backends that serve it
    assert rows[0] == ["sliding", "prefill", "nowindow", "no", "(4)", "ok"]
    assert "[sliding] prefill -> 'nowindow': kv_dtype 'float8_e4m3fn' is served in" in out
    assert rows[3] == ["full", "prefill", "nowindow", "ok", "ok"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--spec", "sliding:torch", *MHA_ARGS], "GROUP:SPEC once for each group"),
        (
            ["--spec", "torch", *MHA_ARGS, "--group", "a", "--group", "a"],
            "each group is named once",
        ),
        (["--spec", "torch", *MHA_ARGS, "--group", "a:window_left=-1"], "window_left"),
        (["--spec", "torch", "--model", "/no/such/model"], "no such file or directory"),
    ],
)
def test_explain_bad_group_and_model_input_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err, err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--group", "a:nosuchfield=1"], "AttnConfig field"),
        (["--group", ":window_left=3"], "names no group"),
        (["--device", "cuda:abc"], "not a device name"),
        (["--model", ".", "--kind", "mha"], "--model derives the layer shapes; drop --kind"),
        (["--heads", "8"], "required: --kind, --head-dim (or --model)"),
    ],
)
def test_explain_usage_errors_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [] if "--model" in args or "--heads" in args else MHA_ARGS
    with pytest.raises(SystemExit) as info:
        main(["explain", "--spec", "torch", *base, *args])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


# Tiny configs of every family use() serves (docs/integrations/transformers.md), saved with
# save_pretrained at test time: name -> (config factory, group -> (window_left, cap, sinks)).
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MIXED = ["sliding_attention", "full_attention"]


def _families() -> dict[str, tuple[Any, dict[str, tuple[int | None, float | None, bool]]]]:
    t = pytest.importorskip("transformers")
    full = {"full": (None, None, False)}
    both = {"sliding": (2, None, False), "full": (None, None, False)}
    return {
        "llama": (lambda: t.LlamaConfig(**TINY), full),
        "qwen2": (lambda: t.Qwen2Config(**TINY), full),
        "deepseek_v3": (
            lambda: t.DeepseekV3Config(
                **{**TINY, "num_key_value_heads": 4},
                kv_lora_rank=32,
                q_lora_rank=None,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                moe_intermediate_size=32,
            ),
            full,
        ),
        "mistral": (
            lambda: t.MistralConfig(**TINY, sliding_window=3),
            {"sliding": both["sliding"]},
        ),
        "qwen2_sliding": (
            lambda: t.Qwen2Config(
                **TINY, use_sliding_window=True, sliding_window=3, max_window_layers=1
            ),
            both,
        ),
        "gemma2": (
            lambda: t.Gemma2Config(
                **TINY, head_dim=16, sliding_window=3, attn_logit_softcapping=0.5
            ),
            {"sliding": (2, 0.5, False), "full": (None, 0.5, False)},
        ),
        "gemma3": (
            lambda: t.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=3, layer_types=MIXED),
            both,
        ),
        "cohere2": (lambda: t.Cohere2Config(**TINY, sliding_window=3, layer_types=MIXED), both),
        "gpt_oss": (
            lambda: t.GptOssConfig(
                **TINY, head_dim=16, sliding_window=3, num_local_experts=4, num_experts_per_tok=2
            ),
            {"sliding": (2, None, True), "full": (None, None, True)},
        ),
    }


def _saved(tmp_path: Path, name: str, config: Any) -> Path:
    folder = tmp_path / name
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        "deepseek_v3",
        "mistral",
        "qwen2_sliding",
        "gemma2",
        "gemma3",
        "cohere2",
        "gpt_oss",
    ],
)
def test_explain_model_maps_each_family_as_use_does(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig

    from attn_dispatch.integrations.transformers import attn_configs_for

    make, expected = _families()[name]
    folder = _saved(tmp_path, name, make())
    # A directory and its config.json read alike.
    for where in (folder, folder / "config.json"):
        assert main(["explain", "--model", str(where), "--spec", "torch"]) == 0
        out = capsys.readouterr().out
        printed = _configs_printed(out)
        assert set(printed) == set(expected), out
        mapped = attn_configs_for(
            AutoConfig.from_pretrained(folder),
            dtype="float32",
            device="cpu",
            sinks=expected[next(iter(expected))][2],
        )
        assert printed == {g: str(c) for g, c in mapped.items()}  # use()'s own mapping
        for group, (window, cap, sinks) in expected.items():
            cfg = mapped[group]
            assert (cfg.window_left, cfg.logit_cap, cfg.sinks) == (window, cap, sinks)
        assert f"model_type {AutoConfig.from_pretrained(folder).model_type!r}" in out
        assert "binds on this machine:" in out
        bound = out.split("binds on this machine:")[1].split()
        assert bound.count("torch") == 3 * len(expected)


def test_explain_model_refusals_set_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.backend import Capabilities

    families = _families()
    gpt = _saved(tmp_path, "gpt_oss", families["gpt_oss"][0]())
    llama = _saved(tmp_path, "llama", families["llama"][0]())
    register_echo(
        "windowonly",
        Capabilities(kinds={"mha"}, devices={"cpu"}, dtypes={"float32"}, variants={"window"}),
    )
    # gpt-oss has sinks: a backend without them is refused with the backends that serve them.
    assert main(["explain", "--model", str(gpt), "--spec", "windowonly"]) == 1
    out = capsys.readouterr().out
    assert "sinks yes" in out
    assert "[sliding] prefill -> 'windowonly': layer variant 'sinks' (sinks=True)" in out
    assert "[full] decode -> 'windowonly': variant 'sinks' is served in phase 'decode' by: " in out
    assert "binds on this machine" not in out
    # Told there are no sinks, the same spec serves it (nothing is built on the meta device).
    assert main(["explain", "--model", str(gpt), "--spec", "windowonly", "--no-sinks"]) == 0
    assert "sinks no" in capsys.readouterr().out
    # One group on another backend: only the refused group's lines.
    args = ["--spec", "sliding:windowonly", "--spec", "full:torch"]
    assert main(["explain", "--model", str(gpt), *args]) == 1
    reasons = capsys.readouterr().out.split("from the config (hold")[1]
    assert "[sliding]" in reasons and "[full]" not in reasons
    # FP8 pages on a backend that declares no FP8 cache; --static for a GPU machine.
    fp8 = ["--kv-dtype", "float8_e4m3fn", "--static"]
    assert main(["explain", "--model", str(llama), "--spec", "windowonly", *fp8]) == 1
    out = capsys.readouterr().out
    assert "[full] prefill,decode,verify -> 'windowonly': kv_dtype 'float8_e4m3fn' is not" in out
    assert "static check: the config cannot be served" in out
    assert main(["explain", "--model", str(llama), "--spec", "torch", *fp8]) == 0


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda t: t.Gemma3TextConfig(
                **TINY, head_dim=16, layer_types=MIXED, use_bidirectional_attention=True
            ),
            "bidirectional",
        ),
        (  # chunked layers are served (Llama 4), but not without a chunk size
            lambda t: t.Qwen2Config(**TINY, layer_types=["full_attention", "chunked_attention"]),
            "'chunked_attention' layers but attention_chunk_size=None",
        ),
    ],
)
def test_explain_model_use_refuses_is_refused_by_name(
    make: Any, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = pytest.importorskip("transformers")
    folder = _saved(tmp_path, "refused", make(t))
    assert main(["explain", "--model", str(folder), "--spec", "torch"]) == 1
    out = capsys.readouterr().out
    assert "cannot serve this model: " in out and words in out


def test_explain_model_serves_llama4_chunked_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = pytest.importorskip("transformers")
    config = t.Llama4TextConfig(
        **{**TINY, "num_hidden_layers": 4}, head_dim=16, attention_chunk_size=8
    )  # default no_rope_layer_interval=4: layers 0-2 chunked (RoPE), layer 3 full (NoPE)
    folder = _saved(tmp_path, "llama4", config)
    assert main(["explain", "--model", str(folder), "--spec", "torch"]) == 0
    out = capsys.readouterr().out
    assert "4 layers: 3 chunked, 1 full" in out
    printed = _configs_printed(out)
    assert set(printed) == {"chunked", "full"}
    assert "attention_chunk_size=8" in printed["chunked"]
    assert "attention_chunk_size=None" in printed["full"]
    assert out.split("binds on this machine:")[1].split().count("torch") == 6
    # A backend without chunked local attention is refused for that group, naming who serves it.
    assert main(["explain", "--model", str(folder), "--spec", "flashinfer", "--static"]) == 1
    out = capsys.readouterr().out
    assert (
        "[chunked] decode -> 'flashinfer': variant 'chunked' is served in phase 'decode' by:" in out
    )


def test_explain_model_unreadable_config_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no_such_family"}')
    for folder in ("empty", "bad"):
        assert main(["explain", "--model", str(tmp_path / folder), "--spec", "torch"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --model=") and "transformers cannot read this config" in err


@pytest.mark.parametrize(
    "args",
    [
        ["explain", "--spec", "torch", "--model", "/no/such/dir"],
        ["explain", "--spec", "torch", *MHA_ARGS, "--device", "cuda:abc"],
        ["explain", "--spec", "torch", *MHA_ARGS, "--group", "x:y"],
        ["matrix", "--format", "yaml"],
        ["matrix", "--fields", "nope"],
        ["demo", "--device", "cuda:abc", "--size", "tiny"],
    ],
)  # fmt: skip
def test_bad_input_never_prints_a_traceback(args: list[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "attn_dispatch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error:" in proc.stderr


# -- bad files and options: one error line, exit 2, never a wait or an internal error --------

_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
_TINY = ["--kind", "mha", "--heads", "4", "--head-dim", "16", "--dtype", "float32"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # A timeout: a command that waits on a FIFO or reads a device without end fails the test
    # instead of hanging it.
    return subprocess.run(
        [sys.executable, "-m", "attn_dispatch", *args],
        capture_output=True,
        text=True,
        env=_ENV,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "fifo_dir", "dev_zero_link", "config_is_a_dir"])
def test_model_config_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    folder = tmp_path / "model"
    folder.mkdir()
    target = folder
    if kind == "fifo":
        target = tmp_path / "config.json"
        os.mkfifo(target)
    elif kind == "fifo_dir":
        os.mkfifo(folder / "config.json")
    elif kind == "dev_zero_link":
        (folder / "config.json").symlink_to("/dev/zero")
    else:
        (folder / "config.json").mkdir()
    line = _one_line(_cli("explain", "--spec", "torch", "--model", str(target)))
    assert "not a regular file" in line, line


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 40 + "1" + "}" * 40])
def test_deeply_nested_model_config_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    line = _one_line(_cli("explain", "--spec", "torch", "--model", str(tmp_path)))
    assert "nests its values deeper than" in line, line


def test_update_readme_of_a_fifo_is_refused(tmp_path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(tmp_path / "README.md")
    line = _one_line(_cli("matrix", "--update-readme", str(tmp_path / "README.md")))
    assert "FIFO" in line, line


def test_tune_on_a_device_this_machine_lacks_is_bad_input() -> None:
    import torch

    devices = ["meta", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        line = _one_line(_cli("tune", *_TINY, "--device", device))
        assert "device=" in line and "internal error" not in line, line
    if not torch.cuda.is_available():
        line = _one_line(_cli("tune", "--demo", "tiny", "--device", "cuda"))
        assert "no CUDA device" in line, line


@pytest.mark.parametrize(
    "sizes", [["--context", "99999999999"], ["--decode-batch", "10000000", "--context", "99999"]]
)
def test_tune_refuses_sizes_beyond_memory(sizes: list[str]) -> None:
    line = _one_line(_cli("tune", *_TINY, *sizes))
    assert "GiB" in line and "more than half of its memory" in line, line


@pytest.mark.parametrize("names", [",", " , ", "torch,,native", "torch,torch"])
def test_tune_refuses_a_backend_list_that_names_nothing_or_twice(names: str) -> None:
    proc = _cli("tune", *_TINY, "--backends", names)
    assert proc.returncode == 2 and "argument --backends" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "recommended" not in proc.stdout


def test_tune_function_refuses_an_empty_backend_list() -> None:
    from attn_dispatch import AttnConfig
    from attn_dispatch._errors import InvalidSpecError
    from attn_dispatch.tune import tune

    cfg = AttnConfig("mha", 4, 2, 16, dtype="float32")
    for names in ([], ["torch", "torch"], "torch"):
        with pytest.raises(InvalidSpecError) as e:
            tune({"": cfg}, backends=names)  # type: ignore[arg-type]
        assert e.value.field == "backends"


@pytest.mark.parametrize("flag", ["--backends", "--fields"])
def test_matrix_refuses_a_list_that_names_nothing(flag: str) -> None:
    assert "names nothing" in _one_line(_cli("matrix", flag, ","))


class _Broken:
    def __init__(self) -> None:
        self.plugin_errors: dict[str, str] = {}

    def list(self) -> dict[str, object]:
        raise KeyError("a bug")


@pytest.mark.parametrize("argv", [["--traceback", "list"], ["list", "--traceback"]])
def test_traceback_flag_shows_where_an_internal_error_happened(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv, registry=_Broken()) == 3  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert "raise KeyError" in err and "in list" in err
    assert err.strip().splitlines()[-1].startswith("error: internal error, please report it")


def test_without_the_flag_the_internal_error_says_how_to_see_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["list"], registry=_Broken()) == 3  # type: ignore[arg-type]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in line and "run again with --traceback" in line


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["explain"],
        ["explain", "--spec", "torch", "--kind", "gqa", "--heads", "1", "--head-dim", "64"],
        ["explain", "--spec", "torch", "--kind", "mha", "--heads", "many", "--head-dim", "64"],
        ["tune", *_TINY, "--backends", ","],
        ["tune", *_TINY, "--repeats", "1e3"],
        ["tune", "--kind", "mha", "--model", "x"],
        ["matrix", "--format", "yaml"],
        ["list", "--nope"],
    ],
)  # fmt: skip
def test_every_usage_error_is_one_line(args: list[str]) -> None:
    line = _one_line(_cli(*args))
    assert "(for usage: python -m attn_dispatch" in line and line.endswith("--help)"), line


@pytest.mark.parametrize("kind", ["fifo", "dev_zero_link"])
def test_a_dispatch_table_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    table = tmp_path / "table.json"
    if kind == "fifo":
        os.mkfifo(table)
    else:
        table.symlink_to("/dev/zero")
    line = _one_line(_cli("explain", *_TINY, "--table", str(table)))
    assert line.startswith("error: --table=") and "not a regular file" in line, line
