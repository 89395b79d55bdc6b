"""``check(spec, config)``: every reason ``bind`` would refuse with, and no backend built."""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import pytest

import attn_dispatch
from attn_dispatch import AttnConfig
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UnknownBackendError
from attn_dispatch import bind
from attn_dispatch import check
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import Registry

MHA = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=8)
TREE = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=8, tree_verify=True)
MLA = AttnConfig("mla", 16, 1, 576, 512, dtype="float32", page_size=8)


class _Counting(BackendBase):
    built: ClassVar[list[str]] = []

    def __init__(self, config: Any, **options: Any) -> None:
        _Counting.built.append(config.kind)

    def plan(self, batch: Any) -> Any:
        return None

    def handler(self, phase: Phase) -> Any:
        return lambda *a, **k: None


@pytest.fixture
def registry() -> Registry:
    _Counting.built = []
    reg = Registry(builtins=False, plugins=False)
    reg.register("mha_only", capabilities=Capabilities(kinds={"mha"}), factory=_Counting)
    reg.register(
        "any", capabilities=Capabilities(kinds={"mha", "mla"}, custom_mask=True), factory=_Counting
    )
    reg.register(
        "gpu", capabilities=Capabilities(kinds={"mha"}, devices={"cuda"}), factory=_Counting
    )
    return reg


def _bind_reasons(spec: Any, config: Any, registry: Registry) -> dict[Phase, Any]:
    with pytest.raises(IncompatibleBackendError) as info:
        bind(spec, config, registry=registry)
    return info.value.reasons


def test_exported_on_the_framework_surface() -> None:
    assert "check" in attn_dispatch.__all__ and attn_dispatch.check is check
    assert check.__module__ == "attn_dispatch"


def test_a_spec_bind_accepts_has_no_reasons_and_nothing_is_built(registry: Registry) -> None:
    assert check("mha_only", MHA, registry=registry) == {}
    assert check("prefill=mha_only,decode=any", MHA, registry=registry) == {}
    assert _Counting.built == []  # check builds nothing
    bind("mha_only", MHA, registry=registry)
    assert _Counting.built == ["mha"]


@pytest.mark.parametrize(
    ("spec", "config"),
    [
        ("mha_only", MLA),  # every phase
        ("prefill=any,decode=mha_only", MLA),  # decode and verify
        ("mha_only", TREE),  # verify only: no custom mask declared
        ("gpu", MHA),  # device (a config reason)
    ],
)
def test_the_reasons_are_binds(spec: str, config: AttnConfig, registry: Registry) -> None:
    got = check(spec, config, registry=registry)
    assert got  # refused
    assert got == _bind_reasons(spec, config, registry)
    assert _Counting.built == []


def test_groups_are_checked_like_bind(registry: Registry) -> None:
    configs = {"full": MHA, "latent": MLA}
    got = check("mha_only", configs, registry=registry)
    assert got == _bind_reasons("mha_only", configs, registry)
    assert all(r.startswith("group 'latent'") for _, why in got.values() for r in why)
    assert check({"full": "mha_only", "latent": "any"}, configs, registry=registry) == {}
    assert _Counting.built == []


def test_machine_false_leaves_this_machines_reasons_out(registry: Registry) -> None:
    reg = Registry(builtins=False, plugins=False)
    reg.register(
        "missing",
        capabilities=Capabilities(kinds={"mha"}, requires=("no_such_module_for_check",)),
        factory=_Counting,
    )
    here = check("missing", MHA, registry=reg)
    assert set(here) == set(Phase)
    assert "no_such_module_for_check" in here[Phase.DECODE][1][0]
    assert check("missing", MHA, registry=reg, machine=False) == {}


def test_what_bind_raises_first_still_raises(registry: Registry) -> None:
    with pytest.raises(UnknownBackendError) as info:
        check("mha_onyl", MHA, registry=registry)
    assert info.value.suggestions[0] == "mha_only"
    with pytest.raises(InvalidSpecError):
        check("prefill=", MHA, registry=registry)
    with pytest.raises(InvalidSpecError, match="mapping group -> config"):
        check({"full": "mha_only"}, MHA, registry=registry)
    with pytest.raises(InvalidSpecError, match="AttnConfig"):
        check("mha_only", object(), registry=registry)  # type: ignore[arg-type]


def test_the_result_is_a_fresh_value(registry: Registry) -> None:
    first = check("mha_only", MLA, registry=registry)
    first.clear()
    assert check("mha_only", MLA, registry=registry)
    backend, why = check("mha_only", MLA, registry=registry)[Phase.DECODE]
    assert backend == "mha_only" and isinstance(why, tuple)
