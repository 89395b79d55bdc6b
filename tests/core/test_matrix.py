"""`python -m attn_dispatch matrix`: the support matrix read from the backends' declarations,
and its generated Markdown blocks (the docs' own blocks are checked in tests/docs)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch._matrix import FIELDS
from attn_dispatch._matrix import fields_of
from attn_dispatch._matrix import format_matrix
from attn_dispatch._matrix import support_matrix
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backend import Registry
from attn_dispatch.cli import main
from tests.strategies import echo_factory
from tests.strategies import register_echo

ROOT = Path(__file__).resolve().parents[2]


def toy_rule(config: AttnConfig, phase: Phase) -> Iterable[str]:
    return []


TOY = Capabilities(
    kinds={"mha"},
    phases={"decode", "verify"},
    devices={"cpu"},
    dtypes={"float16"},
    kv_dtypes={"float16", "float8_e5m2"},
    head_dims={128, 64},
    page_sizes={16},
    custom_mask=False,
    requires=("toy_kernels",),
    min_compute_capability=(9, 0),
    checks=(toy_rule,),
    variants={"decode": {"window", "logit_cap"}, "verify": {"window"}},
    description="a toy",
)
TOY_JSON = {
    "kinds": ["mha"],
    "phases": ["decode", "verify"],
    "devices": ["cpu"],
    "dtypes": ["float16"],
    "kv_dtypes": ["float16", "float8_e5m2"],
    "variants": {"prefill": [], "decode": ["logit_cap", "window"], "verify": ["window"]},
    "forms": ["mla"],
    "form_policy": {
        "no_prefix": "mha",
        "short_prefix": "mla",
        "long_prefix": "mla",
        "short_prefix_max": 2048,
        "decode": "mla",
        "verify": "mla",
    },
    "head_dims": [64, 128],
    "v_head_dims": None,
    "page_sizes": [16],
    "custom_mask": False,
    "plans_scale": False,
    "out_buffer": False,
    "requires": ["toy_kernels"],
    "min_compute_capability": [9, 0],
    "availability": [],
    "checks": ["toy_rule"],
    "description": "a toy",
}


def toy_registry() -> Registry:
    reg = Registry(builtins=False, plugins=False)
    reg.register(
        "toy",
        capabilities=TOY,
        factory=echo_factory("toy"),
        form_policy=FormPolicy.decompressed_without_prefix(),
    )
    return reg


def test_json_is_the_declaration() -> None:
    matrix = support_matrix(toy_registry())
    assert matrix == {"toy": TOY_JSON}
    assert json.loads(format_matrix(matrix, "json")) == {"toy": TOY_JSON}
    assert list(TOY_JSON) == list(FIELDS)  # one row per field, in the matrix's order


def test_text_and_markdown_show_each_declared_value() -> None:
    matrix = support_matrix(toy_registry())
    text = format_matrix(matrix, "text")
    rows: dict[str, str] = {}
    last = ""
    for line in text.splitlines()[2:]:
        if line.startswith(" "):  # a long cell folded onto a continuation line
            rows[last] += " " + line.strip()
        else:
            last, rows[last] = line.split(None, 1)[0], line.split(None, 1)[1]
    assert text.splitlines()[0].split() == ["toy"]
    assert rows["kinds"] == "mha"
    assert rows["phases"] == "decode, verify"
    assert rows["kv_dtypes"] == "float16, float8_e5m2"
    assert rows["variants"] == "prefill: none; decode: logit_cap, window; verify: window"
    assert rows["head_dims"] == "64, 128"
    assert rows["v_head_dims"] == "any"
    assert rows["page_sizes"] == "16"
    assert rows["custom_mask"] == "no"
    assert rows["out_buffer"] == "no"
    assert rows["min_compute_capability"] == "sm90"
    assert rows["checks"] == "toy_rule"
    policy = "prefill mha (no prefix), mla (with prefix); decode mla; verify mla"
    assert rows["form_policy"] == policy
    assert "description" not in rows  # prose only on request
    md = format_matrix(matrix, "markdown", fields=["forms", "page_sizes", "description"])
    assert md.splitlines() == [
        "|  | `toy` |",
        "| --- | --- |",
        "| `forms` | mla |",
        "| `page_sizes` | 16 |",
        "| `description` | a toy |",
    ]


def test_builtin_backends_match_their_capabilities() -> None:
    reg = Registry(plugins=False)
    matrix = support_matrix(reg)
    assert set(matrix) == {"torch", "native", "triton", "flashinfer", "sdpa"}
    for name, caps in reg.list().items():
        row = matrix[name]
        assert set(row["kinds"]) == set(caps.kinds)
        assert row["phases"] == [p.name.lower() for p in sorted(caps.phases)]
        assert set(row["devices"]) == set(caps.devices)
        assert set(row["dtypes"]) == set(caps.dtypes)
        assert row["kv_dtypes"] == (None if caps.kv_dtypes is None else sorted(caps.kv_dtypes))
        for phase in Phase:
            p = phase.name.lower()
            forms, variants = row["forms"], row["variants"]
            assert set(forms[p] if isinstance(forms, dict) else forms) == caps.forms_for(phase)
            got = variants[p] if isinstance(variants, dict) else variants
            assert set(got) == caps.variants_for(phase)
        assert row["custom_mask"] is caps.custom_mask
        assert row["out_buffer"] is caps.out_buffer is True  # every built-in writes out=
        assert row["requires"] == list(caps.requires)
        cc = caps.min_compute_capability
        assert row["min_compute_capability"] == (None if cc is None else list(cc))
    # What differs between them shows: flashinfer declares no sinks, torch every form.
    assert "sinks" not in matrix["flashinfer"]["variants"]
    assert sorted(matrix["torch"]["forms"]) == ["mha", "mha_chunked", "mla"]


def test_a_field_added_to_capabilities_becomes_a_row() -> None:
    # Another field (as attention types or LSE support will be) needs no change to the matrix.
    @dataclasses.dataclass(frozen=True, slots=True)
    class Newer(Capabilities):
        attention_types: frozenset[str] = frozenset({"causal", "chunked"})
        lse: bool = True

    assert fields_of(Newer)[-7:-5] == ("attention_types", "lse")  # before the requirements
    reg = Registry(builtins=False, plugins=False)
    reg.register("new", capabilities=Newer(kinds={"mha"}), factory=echo_factory("new"))
    reg.register("old", capabilities=Capabilities(kinds={"mha"}), factory=echo_factory("old"))
    text = format_matrix(support_matrix(reg), "text", fields=["attention_types", "lse"])
    assert text.splitlines()[2:] == [
        "attention_types  causal, chunked  -",
        "lse              yes              -",
    ]


def test_cli_matrix_includes_registered_backends(capsys: pytest.CaptureFixture[str]) -> None:
    register_echo("thirdparty", TOY)  # as an entry-point plugin would
    try:
        assert main(["matrix", "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["thirdparty"]["variants"] == TOY_JSON["variants"]
        assert {"torch", "native"} <= set(data)
        assert main(["matrix", "--backends", "thirdparty", "--fields", "kinds,devices"]) == 0
        out = capsys.readouterr().out.split()
        assert out == ["thirdparty", "-------", "-" * 10, "kinds", "mha", "devices", "cpu"]
    finally:
        from attn_dispatch.backend import unregister_backend

        unregister_backend("thirdparty")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["matrix", "--fields", "kinds,bogus"], "unknown matrix field"),
        (["matrix", "--backends", "tourch"], "Did you mean 'torch'"),
        (["matrix", "--update-readme", "/no/such/README.md"], "cannot read it"),
    ],
)
def test_cli_matrix_bad_input_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


def test_update_readme_rewrites_stale_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "README.md"
    cmd = "<!-- generated: python -m attn_dispatch matrix --format markdown --fields kinds -->"
    page.write_text(f"intro\n{cmd}\n| stale |\n<!-- end generated -->\nend\n")
    assert main(["matrix", "--update-readme", str(page)]) == 0
    assert capsys.readouterr().out.strip().endswith("updated")
    body = page.read_text().split(cmd + "\n")[1].split("<!-- end generated -->")[0]
    assert body.splitlines()[2].startswith("| `kinds` | mha, mla |")
    assert page.read_text().startswith("intro\n") and page.read_text().endswith("end\n")
    assert main(["matrix", "--update-readme", str(page)]) == 0
    assert capsys.readouterr().out.strip().endswith("up to date")


def test_matrix_imports_no_torch() -> None:
    # The matrix reads declarations only: the core's light modules, never a kernel module.
    import subprocess
    import sys

    code = (
        "import sys; from attn_dispatch.cli import main; rc = main(['matrix']); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "kv_dtypes" in proc.stdout
