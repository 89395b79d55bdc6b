"""BackendSpec: construction, parse/str, dict/JSON, pickle, hash, backend_for, server args."""

from __future__ import annotations

import dataclasses
import json
import pickle
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch.integrations.sglang import spec_from_server_args
from tests.strategies import backend_names
from tests.strategies import backend_specs


def test_uniform() -> None:
    s = BackendSpec.uniform("torch")
    assert s.names == ("torch", "torch", "torch")
    assert str(s) == "torch"
    assert BackendSpec.parse("torch") == s


@pytest.mark.parametrize(
    ("spec", "verify"),
    [
        (BackendSpec("a", "b"), "a"),
        (BackendSpec("a", "b", verify_mode="decode"), "b"),
        (BackendSpec("a", "b", verify="c"), "c"),
        (BackendSpec("a", "b", verify="c", verify_mode="decode"), "c"),
    ],
)
def test_backend_for(spec: BackendSpec, verify: str) -> None:
    assert spec.backend_for(Phase.PREFILL) == "a"
    assert spec.backend_for(Phase.DECODE) == "b"
    assert spec.backend_for(Phase.VERIFY) == verify
    assert spec.names == ("a", "b", verify)


def test_parse_forms() -> None:
    assert BackendSpec.parse("prefill=triton,decode=flashinfer") == BackendSpec(
        "triton", "flashinfer"
    )
    assert BackendSpec.parse("triton,decode=flashinfer") == BackendSpec("triton", "flashinfer")
    assert BackendSpec.parse(" decode = b , prefill = a , verify = c ") == BackendSpec(
        "a", "b", "c"
    )
    assert BackendSpec.parse("a,verify_mode=decode") == BackendSpec("a", "a", verify_mode="decode")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty item"),
        ("a,,b", "empty item"),
        ("a,b", "more than one bare backend name"),
        ("prefill=a", "no backend for decode"),
        ("decode=a", "no backend for prefill"),
        ("prefil=a,decode=b", "unknown key 'prefil'"),
        ("a,prefill=b,prefill=c", "key 'prefill' given twice"),
        ("a,verify_mode=target", "choose 'prefill' (default) or 'decode'"),
        ("prefill=,decode=b", "non-empty backend name"),
    ],
)
def test_parse_errors(text: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec.parse(text)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
    assert words in str(err)
    assert err.field in {"spec", "prefill", "verify_mode"}


def test_parse_not_a_string() -> None:
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec.parse(["torch"])  # type: ignore[arg-type]
    assert info.value.field == "spec" and info.value.value == ["torch"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prefill="", decode="b"), "prefill"),
        (dict(prefill="a", decode=3), "decode"),
        (dict(prefill="a", decode="b", verify=" "), "verify"),
        (dict(prefill="a b", decode="b"), "prefill"),
        (dict(prefill="a", decode="b=c"), "decode"),
        (dict(prefill="a", decode="b", verify_mode="verify"), "verify_mode"),
    ],
)
def test_construct_errors(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec(**kwargs)
    assert info.value.field == field
    assert info.value.value == kwargs[field]
    assert f"{field}={kwargs[field]!r}" in str(info.value)


def test_names_are_stripped() -> None:
    assert BackendSpec(" a ", "b\t") == BackendSpec("a", "b")


def test_frozen_hashable_slotted() -> None:
    s = BackendSpec("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prefill = "c"  # type: ignore[misc]
    assert not hasattr(s, "__dict__")
    assert {s: 1}[BackendSpec("a", "b")] == 1
    # Equal specs hash alike; any field makes a spec different (verify_mode included).
    assert hash(BackendSpec(" a", "b ")) == hash(s)
    others = [
        BackendSpec("a", "b", verify_mode="decode"),
        BackendSpec("a", "b", verify="a"),
        BackendSpec("b", "a"),
    ]
    assert all(o != s for o in others)
    assert len({s, *others}) == 4


@given(backend_specs())
def test_str_parse_round_trip(spec: BackendSpec) -> None:
    assert BackendSpec.parse(str(spec)) == spec


@given(backend_specs())
def test_dict_json_pickle_round_trip(spec: BackendSpec) -> None:
    assert BackendSpec.from_dict(spec.to_dict()) == spec
    assert BackendSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json()) == spec.to_dict()
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and hash(again) == hash(spec)


@given(backend_specs(), st.sampled_from(["prefill", "decode"]))
def test_verify_none_follows_mode(spec: BackendSpec, mode: str) -> None:
    s = dataclasses.replace(spec, verify=None, verify_mode=mode)
    expected = s.prefill if mode == "prefill" else s.decode
    assert s.backend_for(Phase.VERIFY) == expected


@given(backend_names)
def test_uniform_is_bare_name(name: str) -> None:
    assert str(BackendSpec.uniform(name)) == name


def test_from_dict_errors() -> None:
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec.from_dict({"prefill": "a", "decode": "b", "draft": "c"})
    assert "unknown keys ['draft']" in str(info.value)
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec.from_dict({"prefill": "a"})
    assert info.value.field == "spec" and "decode" in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [("{", "not JSON"), ("[1]", "expected a JSON object"), ('"a"', "JSON object")],
)
def test_from_json_errors(text: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec.from_json(text)
    assert words in str(info.value) and info.value.value == text


# -- SGLang server args ---------------------------------------------------------------------


def _args(**kw: Any) -> types.SimpleNamespace:
    base = dict(
        attention_backend=None,
        prefill_attention_backend=None,
        decode_attention_backend=None,
        speculative_attention_mode="prefill",
        speculative_draft_attention_backend=None,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("as_mapping", [False, True])
@pytest.mark.parametrize(
    ("kw", "is_draft", "expected"),
    [
        (dict(attention_backend="fa3"), False, BackendSpec("fa3", "fa3")),
        (
            dict(attention_backend="fa3", decode_attention_backend="flashinfer"),
            False,
            BackendSpec("fa3", "flashinfer"),
        ),
        (
            dict(prefill_attention_backend="triton", decode_attention_backend="flashinfer"),
            False,
            BackendSpec("triton", "flashinfer"),
        ),
        (
            dict(attention_backend="fa3", speculative_attention_mode="decode"),
            False,
            BackendSpec("fa3", "fa3", verify_mode="decode"),
        ),
        # The draft override applies to the draft runner only, for both its phases.
        (
            dict(attention_backend="flashmla", speculative_draft_attention_backend="flashinfer"),
            True,
            BackendSpec("flashinfer", "flashinfer"),
        ),
        (
            dict(attention_backend="flashmla", speculative_draft_attention_backend="flashinfer"),
            False,
            BackendSpec("flashmla", "flashmla"),
        ),
        # A draft without an override follows the target's names.
        (
            dict(prefill_attention_backend="triton", decode_attention_backend="flashinfer"),
            True,
            BackendSpec("triton", "flashinfer"),
        ),
        (
            dict(
                attention_backend="fa3",
                speculative_draft_attention_backend="triton",
                speculative_attention_mode="decode",
            ),
            True,
            BackendSpec("triton", "triton", verify_mode="decode"),
        ),
    ],
)
def test_from_server_args(
    kw: dict[str, Any], is_draft: bool, expected: BackendSpec, as_mapping: bool
) -> None:
    args: Any = dict(vars(_args(**kw))) if as_mapping else _args(**kw)
    assert spec_from_server_args(args, is_draft=is_draft) == expected


def test_from_server_args_missing_attributes_default() -> None:
    # Older server args lack the newer fields entirely.
    args = types.SimpleNamespace(attention_backend="triton")
    assert spec_from_server_args(args) == BackendSpec.uniform("triton")
    assert spec_from_server_args(args, is_draft=True) == BackendSpec.uniform("triton")


@pytest.mark.parametrize(
    ("kw", "missing"),
    [
        (dict(), "prefill"),
        (dict(decode_attention_backend="flashinfer"), "prefill"),
        (dict(prefill_attention_backend="triton"), "decode"),
    ],
)
def test_from_server_args_missing_names(kw: dict[str, Any], missing: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        spec_from_server_args(_args(**kw))
    err = info.value
    assert err.field == "attention_backend" and err.value is None
    assert f"no backend for {missing}" in str(err)
    # A draft without an override has the same problem: nothing is guessed.
    with pytest.raises(InvalidSpecError):
        spec_from_server_args(_args(**kw), is_draft=True)


def test_from_server_args_bad_mode() -> None:
    with pytest.raises(InvalidSpecError) as info:
        spec_from_server_args(_args(attention_backend="fa3", speculative_attention_mode="x"))
    assert info.value.field == "verify_mode" and info.value.value == "x"


class _ResolvedServerArgs:
    """SGLang >= 0.5.23: raw input in the attributes, resolved values in resolved_dict()."""

    def __init__(self, raw: dict[str, Any], resolved: dict[str, Any]) -> None:
        self.__dict__.update(raw)
        self._resolved = resolved

    def resolved_dict(self) -> dict[str, Any]:
        return dict(self._resolved)


def test_from_server_args_prefers_resolved_values() -> None:
    # On this CPU SGLang resolves an unset attention_backend to torch_native.
    args = _ResolvedServerArgs({"attention_backend": None}, {"attention_backend": "torch_native"})
    assert spec_from_server_args(args) == BackendSpec.uniform("torch_native")
    args = _ResolvedServerArgs(
        {"attention_backend": "tokenspeed_mla"},
        {"attention_backend": "cutedsl_mla", "prefill_attention_backend": "trtllm_mla"},
    )
    spec = spec_from_server_args(args)
    assert (spec.prefill, spec.decode) == ("trtllm_mla", "cutedsl_mla")
    assert spec.note is None  # resolved values need no rename


def test_from_server_args_renames_raw_tokenspeed_with_a_note() -> None:
    raw = {"attention_backend": "tokenspeed_mla", "speculative_algorithm": "EAGLE"}
    spec = spec_from_server_args(raw)
    assert (spec.prefill, spec.decode, spec.verify_mode) == ("trtllm_mla", "cutedsl_mla", "decode")
    assert spec.note is not None
    for words in ("'tokenspeed_mla' -> 'cutedsl_mla'", "'trtllm_mla'", "'decode'"):
        assert words in spec.note
    assert "note=" in repr(spec) and "tokenspeed_mla" in repr(spec)
    # The draft extends on trtllm_mla (the factory's build for cutedsl_mla), decodes on
    # cutedsl_mla; DRAFT_EXTEND_V2 (VERIFY) is named since verify_mode would say cutedsl_mla.
    draft = spec_from_server_args(raw, is_draft=True)
    assert draft.names == ("trtllm_mla", "cutedsl_mla", "trtllm_mla")
    assert "draft-extend 'cutedsl_mla' -> 'trtllm_mla'" in (draft.note or "")


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", None])
def test_eagle_draft_extends_on_the_decode_backend_in_mode_decode(algorithm: str | None) -> None:
    args = _args(
        attention_backend="triton",
        decode_attention_backend="flashinfer",
        speculative_attention_mode="decode",
    )
    draft = spec_from_server_args(args, is_draft=True, speculative_algorithm=algorithm)
    assert draft.names == ("flashinfer", "flashinfer", "flashinfer")
    target = spec_from_server_args(args, speculative_algorithm=algorithm)
    assert target.names == ("triton", "flashinfer", "flashinfer")
    # Mode "prefill": the draft extends on the prefill backend.
    args.speculative_attention_mode = "prefill"
    draft = spec_from_server_args(args, is_draft=True, speculative_algorithm=algorithm)
    assert draft.names == ("triton", "flashinfer", "triton")


def test_speculative_algorithm_read_from_args_and_keyword_wins() -> None:
    args = _args(attention_backend="fa4", speculative_algorithm="DFLASH")
    # fa4 is among SGLang's draft choices: the DFLASH draft runs it for everything.
    assert spec_from_server_args(args, is_draft=True) == BackendSpec.uniform("fa4")
    args = _args(prefill_attention_backend="flashmla", decode_attention_backend="triton")
    for algorithm in ("DFLASH", "dspark", types.SimpleNamespace(name="DFLASH")):
        spec = spec_from_server_args(args, is_draft=True, speculative_algorithm=algorithm)  # type: ignore[arg-type]
        assert spec.names == ("flashinfer",) * 3  # flashmla is not a DFLASH draft choice
        assert spec.note is not None and "'flashmla' -> 'flashinfer'" in spec.note
    spec = spec_from_server_args(
        _args(attention_backend="triton", speculative_draft_attention_backend="fa3"),
        is_draft=True,
        speculative_algorithm="DSPARK",
    )
    assert spec == BackendSpec.uniform("fa3") and spec.note is None


def test_ngram_has_no_draft_runner() -> None:
    args = _args(attention_backend="triton", speculative_algorithm="NGRAM")
    assert spec_from_server_args(args) == BackendSpec.uniform("triton")
    with pytest.raises(InvalidSpecError) as info:
        spec_from_server_args(args, is_draft=True)
    assert info.value.field == "speculative_algorithm" and info.value.value == "NGRAM"
    assert "no draft" in str(info.value)


@pytest.mark.parametrize("bad", ["MEDUSA", "", 3])
def test_unknown_speculative_algorithm(bad: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        spec_from_server_args(
            _args(attention_backend="triton"),
            speculative_algorithm=bad,  # type: ignore[arg-type]
        )
    assert info.value.field == "speculative_algorithm" and info.value.value == bad
    assert "'EAGLE'" in str(info.value) and "'DFLASH'" in str(info.value)


def test_note_is_provenance_not_identity() -> None:
    plain = BackendSpec("trtllm_mla", "cutedsl_mla")
    noted = BackendSpec("trtllm_mla", "cutedsl_mla", note="renamed by SGLang")
    assert noted == plain and hash(noted) == hash(plain)
    assert {noted: 1}[plain] == 1
    copy = pickle.loads(pickle.dumps(noted))
    assert copy == noted and copy.note == "renamed by SGLang"
    assert BackendSpec.from_dict(noted.to_dict()).note == "renamed by SGLang"
    assert BackendSpec.from_json(noted.to_json()).note == "renamed by SGLang"
    assert "note" not in plain.to_dict()  # unchanged dict for specs without a note
    assert str(noted) == str(plain)  # the text form names backends only
    assert BackendSpec.parse(str(noted)) == noted
    with pytest.raises(dataclasses.FrozenInstanceError):
        noted.note = "x"  # type: ignore[misc]
    with pytest.raises(InvalidSpecError) as info:
        BackendSpec("a", "b", note=3)  # type: ignore[arg-type]
    assert info.value.field == "note"
