"""attn_dispatch.testing.strategies: what they draw is valid, and the kit's properties hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import Capabilities
from attn_dispatch.testing import assert_isolated
from attn_dispatch.testing import strategies as ads
from tests.strategies import FakeBatch
from tests.strategies import RegistrySnapshot
from tests.strategies import register_echo


def test_small_profile_is_registered_and_small() -> None:
    assert settings.get_profile(ads.SMALL_PROFILE).max_examples <= 25
    assert ads.small.deadline is None


@pytest.mark.parametrize("name", ["torch", "native"])
@ads.small
@given(data=st.data())
def test_configs_for_a_backend_bind(name: str, data: st.DataObject) -> None:
    from attn_dispatch.backend import list_backends

    missing = list_backends()[name].availability_reasons("cpu")
    if missing:
        pytest.skip(f"backend {name!r} cannot run here: {missing[0]}")
    config = data.draw(ads.configs_for(name, device="cpu"))
    binding = bind(BackendSpec.uniform(name), config, label="t")
    assert binding.config == config


RESTRICTED = Capabilities(
    kinds={"mha"},
    phases={Phase.PREFILL, Phase.DECODE},
    devices={"cpu"},
    dtypes={"bfloat16"},
    head_dims={64, 128},
    page_sizes={16},
    custom_mask=False,
    variants={Phase.DECODE: {"window"}, Phase.PREFILL: {"window", "logit_cap"}},
)


@ads.small
@given(config=ads.configs_for(RESTRICTED))
def test_configs_for_respects_declared_capabilities(config: AttnConfig) -> None:
    assert config.kind == "mha" and config.dtype == "bfloat16" and config.page_size == 16
    assert config.head_dim in {64, 128} and not config.tree_verify
    # Variants only where every implemented phase serves them (the cap is prefill-only).
    assert config.variants <= {"window"}
    assert not RESTRICTED.config_reasons(config, Phase.DECODE)


@ads.small
@given(spec=ads.backend_specs(["a", "b"]))
def test_backend_specs_over_names(spec: BackendSpec) -> None:
    assert set(spec.names) <= {"a", "b"}
    assert BackendSpec.parse(str(spec)) == spec


@ads.small
@given(data=st.data(), phase=ads.phases)
def test_paged_batches_plan_on_the_reference_backend(data: st.DataObject, phase: Phase) -> None:
    pytest.importorskip("torch")
    config = data.draw(
        ads.configs_for("torch", phases=[phase], device="cpu").filter(lambda c: c.kind == "mha")
    )
    batch = data.draw(ads.paged_batches(config, phase=phase))
    assert batch.phase is phase and batch.page_size == config.page_size
    if phase is Phase.DECODE:
        assert batch.num_tokens == batch.num_requests
    binding = bind("torch", config, label="t")
    with attn_scope(binding, batch):  # plans: the batch meets the data contract
        pass


@ads.small
@given(data=st.data())
def test_grouped_paged_batches_share_requests(data: st.DataObject) -> None:
    pytest.importorskip("torch")
    base = AttnConfig("mha", 4, 2, 64, dtype="float32", page_size=4)
    groups = {"sliding": base.replace(window_left=7), "full": base}
    grouped = data.draw(ads.paged_batches(groups, phase=Phase.DECODE))
    full, sliding = grouped.group_batches["full"], grouped.group_batches["sliding"]
    assert full.num_requests == sliding.num_requests
    assert full.qo_indptr.tolist() == sliding.qo_indptr.tolist()
    # The sliding group keeps at most the pages its window still sees.
    assert sliding.kv_indices.numel() <= full.kv_indices.numel()
    with attn_scope(bind("torch", groups, label="g"), grouped):
        pass


@ads.small
@given(layout=ads.batch_layouts(phase=Phase.VERIFY, trees=True))
def test_batch_layouts_trees_point_backwards(layout: ads.BatchLayout) -> None:
    if layout.trees is not None:
        for tree, q in zip(layout.trees, layout.q_lens, strict=True):
            assert len(tree) == q and all(-1 <= p < j for j, p in enumerate(tree))
    pages = [p for t in layout.page_tables for p in t]
    assert len(pages) == len(set(pages)) and max(pages) < layout.num_pages


@ads.small
@given(
    runners=ads.runner_sets(["ra", "rb", "rc"], configs=ads.attn_configs(kinds=["mha"])),
    order=st.permutations(range(4)),
)
def test_any_runner_set_leaves_the_target_isolated(
    runners: tuple[ads.RunnerPlan, ...], order: list[int]
) -> None:
    # The library's own promise, checked by the kit: whatever other runners exist, bound in
    # whatever order, the target dispatches the same.
    assert len({r.label for r in runners}) == len(runners)
    snap = RegistrySnapshot()
    try:
        for name in ("ra", "rb", "rc"):
            register_echo(name)
        target = runners[0]

        def serve(plans: tuple[ads.RunnerPlan, ...]) -> None:
            ranked = sorted(plans, key=lambda p: order[plans.index(p) % 4])
            bindings = [bind(p.spec, p.config, label=p.label) for p in ranked]
            for phase in Phase:
                for b in bindings:
                    with attn_scope(b, FakeBatch(phase)):
                        attention(None, None, sm_scale=b.config.sm_scale or 1.0)

        assert_isolated("target", lambda: serve((target,)), lambda: serve(runners))
    finally:
        snap.restore()
