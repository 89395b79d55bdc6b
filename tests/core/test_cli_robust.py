"""The command line never shows a traceback: a closed output pipe ends it quietly, a file it
cannot read is one ``error:`` line, and ``explain --model`` reads only the config (bounded
time), refusing nonsensical values the same way whatever the flags.

Each case runs ``python -m attn_dispatch`` in a subprocess, as a user's shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attn_dispatch.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def run(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attn_dispatch", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        timeout=300,
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", [["matrix"], ["list"], ["matrix", "--format", "markdown"]])
def test_a_closed_pipe_ends_the_command_quietly(command: list[str]) -> None:
    # `python -m attn_dispatch matrix | head -1`, made deterministic: the reading end is
    # closed before the command writes anything, so its first flush meets EPIPE.
    read, write = os.pipe()
    os.close(read)
    try:
        proc = run(*command, stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


def test_head_of_the_matrix_through_a_shell() -> None:
    proc = subprocess.run(
        f"{sys.executable} -m attn_dispatch matrix | head -1",
        shell=True,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_update_readme_of_a_non_utf8_file_is_one_error_line(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    data = b"# caf\xe9\n<!-- matrix -->\n"
    readme.write_bytes(data)
    proc = run("matrix", "--update-readme", str(readme))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "--update-readme=" in line and "not UTF-8" in line, line
    assert readme.read_bytes() == data  # never half-written


def test_update_readme_of_a_directory_is_one_error_line(tmp_path: Path) -> None:
    proc = run("matrix", "--update-readme", str(tmp_path))
    assert proc.returncode == 2
    assert "cannot read it" in one_error_line(proc)


def test_an_internal_error_is_one_line_and_status_3(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken:
        def __init__(self) -> None:
            self.plugin_errors: dict[str, str] = {}

        def list(self) -> dict[str, object]:
            raise KeyError("a bug")

    assert main(["list"], registry=Broken()) == 3  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: internal error, please report it: KeyError")


# -- explain --model: the config only -------------------------------------------------------

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "torch_dtype": "float32",
}


def saved(tmp_path: Path, name: str, **changes: object) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


BAD = [
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"hidden_size": -64}, "hidden_size=-64"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000"),
    ({"head_dim": "64"}, "head_dim='64'"),
    ({"num_attention_heads": True}, "num_attention_heads=True"),
    ({"sliding_window": -5}, "sliding_window=-5"),
    ({"text_config": {"num_key_value_heads": 0}}, "text_config.num_key_value_heads=0"),
]
FLAGS = [[], ["--no-sinks"], ["--sinks"], ["--static"], ["--dtype", "float16"]]


@pytest.mark.parametrize(("change", "words"), BAD)
def test_nonsensical_config_values_are_refused_alike_whatever_the_flags(
    tmp_path: Path, change: dict[str, object], words: str
) -> None:
    folder = saved(tmp_path, "bad", **change)
    lines = set()
    for flags in FLAGS:
        started = time.perf_counter()
        proc = run("explain", "--spec", "torch", "--model", str(folder), *flags)
        elapsed = time.perf_counter() - started
        assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
        line = one_error_line(proc)
        assert words in line and "expected a whole number" in line, line
        lines.add(line)
        # Refused before transformers or torch is imported: an interpreter's start-up only.
        assert elapsed < 20, elapsed
    assert len(lines) == 1, lines  # the same refusal whatever the flags


def test_the_nonsense_check_runs_before_torch_is_imported(tmp_path: Path) -> None:
    folder = saved(tmp_path, "bad", num_attention_heads=0)
    code = (
        "import sys\n"
        "from attn_dispatch.cli import main\n"
        f"rc = main(['explain', '--spec', 'torch', '--model', {str(folder)!r}])\n"
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr


def test_a_huge_config_file_is_refused_unread(tmp_path: Path) -> None:
    folder = tmp_path / "huge"
    folder.mkdir()
    with open(folder / "config.json", "wb") as f:
        f.truncate((16 << 20) + 1)  # sparse: a size, no data
    proc = run("explain", "--spec", "torch", "--model", str(folder))
    assert proc.returncode == 2 and "a model config is far smaller" in one_error_line(proc)


def test_explain_model_builds_no_model_and_takes_bounded_time(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from attn_dispatch.cli import explain

    # Warm the imports (torch, transformers) with a small config, then time the largest
    # config the bounds allow: a million layers of 8 groups of 64 heads. Building it, even on
    # the meta device, would take minutes; reading it must not.
    small = saved(tmp_path, "small")
    big = saved(
        tmp_path, "big", num_hidden_layers=1 << 20, num_attention_heads=512,
        num_key_value_heads=8, hidden_size=512 * 128,
    )  # fmt: skip
    parser = __import__("argparse").ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    explain.add_parser(sub)
    for folder in (small, big):
        args = parser.parse_args(["explain", "--spec", "torch", "--model", str(folder)])
        started = time.perf_counter()
        from attn_dispatch.cli.model import model_configs

        configs, header = model_configs(args)
        elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"reading a config took {elapsed:.2f} s"
    assert configs["full"].num_q_heads == 512 and configs["full"].num_kv_heads == 8
    assert f"{1 << 20} layers" in header[0] and "sinks no (model type 'llama'" in header[0]


def test_gpt_oss_sinks_come_from_its_model_type_without_a_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = saved(
        tmp_path, "gpt", model_type="gpt_oss", architectures=["GptOssForCausalLM"], head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    proc = run("explain", "--spec", "torch", "--model", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert "sinks yes (model type 'gpt_oss'" in proc.stdout
    assert "sinks=True" in proc.stdout
    proc = run("explain", "--spec", "torch", "--model", str(folder), "--no-sinks")
    assert proc.returncode == 0 and "sinks no (as given)" in proc.stdout
