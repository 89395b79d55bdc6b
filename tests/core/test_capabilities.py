"""Capabilities.reasons: one reason per mismatched field; checks and availability never raise."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch.backend import Capabilities
from tests.strategies import mha_config
from tests.strategies import mla_config


def test_everything_fits() -> None:
    caps = Capabilities(kinds={"mha", "mla"})
    for p in Phase:
        assert caps.reasons(mha_config(), p) == []
        assert caps.reasons(mla_config(), p) == []


def test_normalises_fields() -> None:
    caps = Capabilities(
        kinds=["mha"],
        phases=["decode", Phase.PREFILL],
        devices=["CUDA"],
        dtypes=["bf16"],
        kv_dtypes=["fp8"],
        head_dims=[64],
        requires=["torch"],  # type: ignore[arg-type]
    )
    assert caps.kinds == frozenset({"mha"})
    assert caps.phases == frozenset({Phase.DECODE, Phase.PREFILL})
    assert caps.devices == frozenset({"cuda"})
    assert caps.dtypes == frozenset({"bfloat16"})
    assert caps.kv_dtypes == frozenset({"float8_e4m3fn"})
    assert caps.head_dims == frozenset({64})
    assert caps.requires == ("torch",)
    hash(caps)  # frozen sets and tuples only: hashable


@pytest.mark.parametrize(
    ("caps", "config", "phase", "reason"),
    [
        (
            Capabilities(kinds={"mha", "mla"}, phases={Phase.PREFILL, Phase.DECODE}),
            mha_config(),
            Phase.VERIFY,
            "phase 'verify' is not implemented (implemented: 'decode', 'prefill')",
        ),
        (
            Capabilities(kinds={"mha"}),
            mla_config(),
            Phase.DECODE,
            "kind 'mla' is not supported (supported: 'mha')",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, devices={"cuda"}),
            mha_config(),
            Phase.DECODE,
            "device 'cpu' is not supported (supported: 'cuda')",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, dtypes={"float16"}, kv_dtypes={"float32"}),
            mha_config(),
            Phase.DECODE,
            "dtype 'float32' is not supported (supported: 'float16')",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, kv_dtypes={"float8_e4m3fn"}),
            mha_config(),
            Phase.DECODE,
            "kv_dtype 'float32' is not supported (supported: 'float8_e4m3fn')",
        ),
        (
            Capabilities(kinds={"mha", "mla"}),
            mha_config(kv_dtype="fp8"),
            Phase.DECODE,
            "kv_dtype 'float8_e4m3fn' is not supported",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, head_dims={128, 256}),
            mha_config(),
            Phase.PREFILL,
            "head_dim 64 is not supported (supported: 128, 256)",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, v_head_dims={128}),
            mla_config(),
            Phase.DECODE,
            "v_head_dim 512 is not supported (supported: 128)",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, page_sizes={16, 64}),
            mha_config(page_size=1),
            Phase.DECODE,
            "page_size 1 is not supported (supported: 16, 64)",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, custom_mask=False),
            mha_config(tree_verify=True),
            Phase.VERIFY,
            "tree verify needs a custom attention mask",
        ),
        (
            Capabilities(kinds={"mha", "mla"}, requires=("no_such_module_xyz",)),
            mha_config(),
            Phase.DECODE,
            "module 'no_such_module_xyz' is not installed (pip install no-such-module-xyz)",
        ),
    ],
)
def test_each_field_gives_its_reason(
    caps: Capabilities, config: AttnConfig, phase: Phase, reason: str
) -> None:
    reasons = caps.reasons(config, phase)
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith(reason), reasons


def test_custom_mask_matters_only_for_tree_verify() -> None:
    caps = Capabilities(kinds={"mha", "mla"}, custom_mask=False)
    assert caps.reasons(mha_config(tree_verify=True), Phase.DECODE) == []
    assert caps.reasons(mha_config(tree_verify=True), Phase.PREFILL) == []
    assert caps.reasons(mha_config(tree_verify=False), Phase.VERIFY) == []


def test_every_reason_together() -> None:
    caps = Capabilities(
        kinds={"mha"},
        phases={Phase.DECODE},
        devices={"cuda"},
        dtypes={"float16"},
        head_dims={128},
        v_head_dims={128},
        page_sizes={64},
        requires=("no_such_mod_q",),
    )
    reasons = caps.reasons(mla_config(), Phase.PREFILL)
    for word in (
        "phase",
        "kind",
        "device",
        "dtype 'bfloat16'",
        "kv_dtype",
        "head_dim 576",
        "v_head_dim 512",
        "page_size",
        "no_such_mod_q",
    ):
        assert any(word in r for r in reasons), (word, reasons)
    assert len(reasons) == 9


def test_checks_receive_config_and_phase() -> None:
    seen: list[tuple[AttnConfig, Phase]] = []

    def only_even_heads(config: AttnConfig, phase: Phase) -> Iterable[str]:
        seen.append((config, phase))
        if config.num_q_heads % 2:
            yield f"odd head count {config.num_q_heads} in {phase.name.lower()}"

    caps = Capabilities(kinds={"mha", "mla"}, checks=(only_even_heads,))
    assert caps.reasons(mha_config(num_q_heads=8), Phase.DECODE) == []
    assert caps.reasons(mha_config(num_q_heads=7, num_kv_heads=1), Phase.VERIFY) == [
        "odd head count 7 in verify"
    ]
    assert [p for _, p in seen] == [Phase.DECODE, Phase.VERIFY]


def test_check_that_raises_becomes_a_reason() -> None:
    def broken(config: AttnConfig, phase: Phase) -> Iterable[str]:
        raise ZeroDivisionError("oops")

    def fine(config: AttnConfig, phase: Phase) -> Iterable[str]:
        return ["second check still ran"]

    reasons = Capabilities(kinds={"mha", "mla"}, checks=(broken, fine)).reasons(
        mha_config(), Phase.DECODE
    )
    assert len(reasons) == 2
    assert "broken" in reasons[0] and "ZeroDivisionError: oops" in reasons[0]
    assert "failed" in reasons[0]
    assert reasons[1] == "second check still ran"


def test_check_returning_one_string_is_one_reason() -> None:
    caps = Capabilities(kinds={"mha", "mla"}, checks=(lambda c, p: "head_dim too big",))
    assert caps.reasons(mha_config(), Phase.DECODE) == ["head_dim too big"]


def test_availability_is_a_reason_like_any_other() -> None:
    calls = []

    def not_built() -> Iterable[str]:
        calls.append(1)
        return ["not built: run pip install -e ."]

    def crashes() -> Iterable[str]:
        raise OSError("no driver")

    caps = Capabilities(kinds={"mha", "mla"}, availability=(not_built, crashes))
    assert caps.availability_reasons() == [
        "not built: run pip install -e .",
        caps.availability_reasons()[1],
    ]
    assert "OSError: no driver" in caps.availability_reasons()[1]
    reasons = caps.reasons(mha_config(), Phase.PREFILL)
    assert reasons[0] == "not built: run pip install -e ." and "no driver" in reasons[1]
    assert len(calls) == 4


def test_cuda_device_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    reasons = Capabilities(kinds={"mha", "mla"}, devices={"cuda"}).reasons(
        mha_config(device="cuda"), Phase.DECODE
    )
    assert reasons == ["needs CUDA: torch.cuda.is_available() is False on this machine"]


def test_min_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    caps = Capabilities(kinds={"mha", "mla"}, devices={"cuda"}, min_compute_capability=(8, 0))
    assert caps.reasons(mha_config(device="cuda:0"), Phase.DECODE) == [
        "needs compute capability >= sm80, device 'cuda:0' is sm75"
    ]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert caps.reasons(mha_config(device="cuda:0"), Phase.DECODE) == []

    def no_device(device: object = None) -> tuple[int, int]:
        raise RuntimeError("invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_device)
    (reason,) = caps.reasons(mha_config(device="cuda:3"), Phase.DECODE)
    assert "cannot query CUDA device 'cuda:3'" in reason and "invalid device ordinal" in reason


def test_cpu_config_never_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")

    def boom() -> bool:
        raise AssertionError("CUDA queried for a CPU config")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    caps = Capabilities(
        kinds={"mha", "mla"}, devices={"cpu", "cuda"}, min_compute_capability=(9, 0)
    )
    assert caps.reasons(mha_config(device="cpu"), Phase.DECODE) == []


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (dict(kinds="mha"), "kinds", "set of values"),
        (dict(phases="decode"), "phases", "set of values"),
        (dict(devices="cuda"), "devices", "set of values"),
        (dict(dtypes="bfloat16"), "dtypes", "set of values"),
        (dict(kv_dtypes="fp8"), "kv_dtypes", "set of values"),
        (dict(head_dims=64), "head_dims", "set of values"),
        (dict(head_dims=[64, "128"]), "head_dims", "positive int"),
        (dict(head_dims=[64.0]), "head_dims", "positive int"),
        (dict(head_dims=[0]), "head_dims", "positive int"),
        (dict(head_dims=[True]), "head_dims", "positive int"),
        (dict(v_head_dims=[-1]), "v_head_dims", "positive int"),
        (dict(page_sizes="16"), "page_sizes", "set of values"),
        (dict(requires="torch"), "requires", "set of values"),
        (dict(forms="mla"), "forms", "set of values"),
        (dict(forms={"decode": "mla"}), "forms['decode']", "set of values"),
        (dict(forms={"mla", "absorbed"}), "forms", "unknown forms"),
        (dict(kinds={"mha", "gqa"}), "kinds", "unknown kinds"),
        (dict(phases={"decode", "extend"}), "phases", "unknown phase"),
        (dict(dtypes={"float64"}), "dtypes", "unknown dtype"),
        (dict(devices={""}), "devices", "non-empty str"),
        (dict(checks=lambda c, p: []), "checks", "tuple of functions"),
        (dict(availability=(42,)), "availability", "callable"),
        (dict(custom_mask="yes"), "custom_mask", "bool"),
        (dict(plans_scale=1), "plans_scale", "bool"),
        (dict(min_compute_capability=8), "min_compute_capability", "(major, minor)"),
        (dict(kinds=None), "kinds", "declare the kinds"),
        (dict(kinds=set()), "kinds", "declare the kinds"),
    ],
)
def test_bad_fields_raise_invalid_spec_error(
    kwargs: dict[str, object], field: str, words: str
) -> None:
    # A str where a set belongs would silently become a set of characters ({"m", "h", "a"}).
    with pytest.raises(InvalidSpecError) as info:
        Capabilities(**{"kinds": {"mha"}, **kwargs})  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field
    assert words in str(err), str(err)


def test_kinds_must_be_declared() -> None:
    # 0.1 defaulted to both kinds: a backend that declared nothing bound MLA layers.
    with pytest.raises(InvalidSpecError, match="declare the kinds") as info:
        Capabilities()
    assert info.value.field == "kinds" and info.value.value is None


def test_custom_mask_is_off_unless_declared() -> None:
    # 0.1 defaulted to True: a backend that declared nothing bound tree verify.
    tree = mha_config(tree_verify=True)
    caps = Capabilities(kinds={"mha"})
    assert caps.custom_mask is False
    assert caps.reasons(tree, Phase.VERIFY) == [
        "tree verify needs a custom attention mask, which this backend does not support"
    ]
    assert Capabilities(kinds={"mha"}, custom_mask=True).reasons(tree, Phase.VERIFY) == []
