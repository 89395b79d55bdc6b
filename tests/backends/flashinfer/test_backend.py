"""FlashInfer backend: capability reasons, installed signatures, adapter semantics.

CPU-only parts: the light module's reasons (all at once, "needs CUDA" first), the version
check, every keyword the adapter passes against the installed FlashInfer signatures, and
the adapter's translation of our paged-KV contract (page table, causal/tree mask, MLA
packing, scale re-plan, CUDA-graph buffers) run through recording stand-ins for the
FlashInfer wrappers that compute attention with FlashInfer's documented semantics.
The real kernels run only on CUDA (tests/contract and bench/gpu_flashinfer.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import subprocess
import sys
from typing import Any
from typing import ClassVar

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch._vocab import VARIANTS
from attn_dispatch.backends import flashinfer as fi_caps
from tests import oracle

torch = pytest.importorskip("torch")

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer-python not installed")


def mla(**kw: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mla",
        num_q_heads=16,
        num_kv_heads=1,
        head_dim=576,
        v_head_dim=512,
        dtype="bfloat16",
        page_size=64,
        device="cuda",
    )
    base.update(kw)
    return AttnConfig(**base)


def mha(**kw: Any) -> AttnConfig:
    base: dict[str, Any] = dict(
        kind="mha",
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        v_head_dim=128,
        dtype="bfloat16",
        page_size=16,
        device="cuda",
    )
    base.update(kw)
    return AttnConfig(**base)


# ---------------------------------------------------------------------------------------
# Light module
# ---------------------------------------------------------------------------------------


def test_light_module_imports_neither_torch_nor_flashinfer() -> None:
    code = (
        "import sys, attn_dispatch.backends.flashinfer as m\n"
        "assert m.CAPABILITIES is not None\n"
        "bad = [x for x in ('torch', 'flashinfer', 'triton') if x in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"light module imported {out}"


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.7.0", True),
        ("0.7.4", True),
        ("0.7.10.post1", True),
        ("0.8.0", False),
        ("0.6.9", False),
        ("1.0.0rc1", False),
        ("garbage", False),
    ],
)
def test_version_range(version: str, ok: bool) -> None:
    assert fi_caps.version_supported(version) is ok


@needs_flashinfer
def test_installed_version_is_supported_and_read_without_import() -> None:
    version = fi_caps.installed_version()
    assert version is not None
    assert fi_caps.version_supported(version), version
    assert list(fi_caps._available_installed()) == []


def test_unsupported_version_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_caps, "installed_version", lambda: "0.9.1")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    reasons = list(fi_caps._available_installed())
    assert len(reasons) == 1
    assert "'0.9.1'" in reasons[0] and fi_caps.SUPPORTED_VERSIONS in reasons[0]


def test_missing_flashinfer_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name)
    )
    reasons = list(fi_caps._available_installed())
    assert len(reasons) == 1 and reasons[0].startswith("not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cpu_reasons_all_at_once() -> None:
    cfg = mla(
        head_dim=352,
        v_head_dim=320,
        dtype="float32",
        kv_dtype="float32",
        device="cpu",
        tree_verify=True,
        num_q_heads=48,
    )
    reasons = fi_caps.CAPABILITIES.reasons(cfg, Phase.VERIFY)
    text = "\n".join(reasons)
    assert any(r.startswith("needs CUDA") for r in reasons), text
    assert "head_dim=352" in text and "v_head_dim=320" in text, text
    assert "tree verify" in text and "'triton'" in text and "'torch'" in text, text
    assert "num_q_heads=48" in text, text
    assert "float32" in text, text  # dtype, reported by the core's dtype rule
    # the phase-free reasons hold in DECODE too; the verify-only ones do not
    decode = fi_caps.CAPABILITIES.reasons(cfg, Phase.DECODE)
    assert not any("tree verify" in r or "num_q_heads" in r for r in decode)
    assert any("head_dim=352" in r for r in decode)


_SEED = (
    "import sys\n"
    "from attn_dispatch import AttnConfig, BackendSpec, IncompatibleBackendError, bind\n"
    "cfg = AttnConfig(kind='mla', num_q_heads=16, num_kv_heads=1, head_dim=352,\n"
    "                 v_head_dim=320, dtype='bfloat16', page_size=64, device='cuda')\n"
    "try:\n"
    "    bind(BackendSpec.parse('prefill=torch,decode=flashinfer'), cfg, label='target')\n"
    "except IncompatibleBackendError as exc:\n"
    "    for phase, (name, why) in sorted(exc.reasons.items()):\n"
    "        print(phase.name, name, *why, sep=' | ')\n"
    "print('flashinfer imported:', 'flashinfer' in sys.modules)\n"
)


def test_seed_scenario_refused_at_bind_before_flashinfer_is_imported() -> None:
    # SGLang 28528: FlashInfer's MLA path chosen for dims it cannot serve died on an
    # assertion inside a kernel. Here bind refuses it, naming the dims, and FlashInfer
    # is never imported.
    out = subprocess.run(
        [sys.executable, "-c", _SEED], capture_output=True, text=True, check=True
    ).stdout
    decode = [line for line in out.splitlines() if line.startswith("DECODE | flashinfer")]
    assert decode and "head_dim=352" in decode[0] and "v_head_dim=320" in decode[0], out
    if not torch.cuda.is_available():
        assert "needs CUDA" in decode[0], out  # every reason at once
    torch_lines = [ln for ln in out.splitlines() if ln.split(" | ")[1:2] == ["torch"]]
    assert not any("head_dim=352" in ln for ln in torch_lines), out
    assert "flashinfer imported: False" in out, out


def test_mla_tree_verify_on_flashinfer_is_refused_naming_the_alternatives() -> None:
    from attn_dispatch import BackendSpec
    from attn_dispatch import IncompatibleBackendError
    from attn_dispatch import bind

    spec = BackendSpec.parse("prefill=torch,decode=flashinfer,verify=flashinfer")
    with pytest.raises(IncompatibleBackendError) as err:
        bind(spec, mla(tree_verify=True))
    name, reasons = err.value.reasons[Phase.VERIFY]
    assert name == "flashinfer"
    tree = [r for r in reasons if "tree verify" in r]
    assert tree and "'triton'" in tree[0] and "'torch'" in tree[0]
    # decode is refused only for machine reasons (no CUDA here), never for the tree
    if Phase.DECODE in err.value.reasons:
        assert not any("tree" in r for r in err.value.reasons[Phase.DECODE][1])


def test_cli_explain_shows_the_reasons() -> None:
    cmd = [
        sys.executable,
        "-m",
        "attn_dispatch",
        "explain",
        "--spec",
        "prefill=torch,decode=flashinfer",
        "--kind",
        "mla",
        "--heads",
        "16",
        "--head-dim",
        "352",
        "--v-head-dim",
        "320",
        "--page-size",
        "64",
        "--device",
        "cuda",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "flashinfer" in run.stdout
    assert "rope width 32" in run.stdout and "v_head_dim=320" in run.stdout, run.stdout


@pytest.mark.parametrize(
    ("cfg", "phase", "fragment"),
    [
        (mla(head_dim=352, v_head_dim=320), Phase.DECODE, "rope width 32"),
        (mla(head_dim=576, v_head_dim=448), Phase.DECODE, "v_head_dim=448"),
        (mla(tree_verify=True), Phase.VERIFY, "no custom mask"),
        (mla(num_q_heads=24), Phase.PREFILL, "num_q_heads=24"),
        (mla(num_q_heads=256), Phase.VERIFY, "num_q_heads=256"),
        (mha(head_dim=96, v_head_dim=96), Phase.DECODE, "head_dim=96"),
        (mha(head_dim=128, v_head_dim=64), Phase.PREFILL, "v_head_dim=64"),
        (mha(kv_dtype="float16"), Phase.DECODE, "kv_dtype='float16'"),
    ],
)
def test_config_rules_refuse(cfg: AttnConfig, phase: Phase, fragment: str) -> None:
    reasons = fi_caps.CAPABILITIES.reasons(cfg, phase)
    assert any(fragment in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("cfg", "phase"),
    [
        (mla(), Phase.DECODE),
        (mla(), Phase.VERIFY),  # causal chain
        (mla(num_q_heads=128), Phase.PREFILL),
        (mla(head_dim=192, v_head_dim=128), Phase.DECODE),
        (mla(tree_verify=True), Phase.DECODE),  # the mask only matters for VERIFY
        (mha(tree_verify=True), Phase.VERIFY),
        (mha(head_dim=192, v_head_dim=128), Phase.PREFILL),
        (mha(head_dim=64, v_head_dim=64, num_q_heads=40, num_kv_heads=8), Phase.DECODE),
    ],
)
def test_config_rules_accept(cfg: AttnConfig, phase: Phase) -> None:
    # Only machine reasons (no CUDA here) may remain; nothing about the config itself.
    config_reasons = [r for c in fi_caps.CAPABILITIES.checks for r in c(cfg, phase)]
    assert config_reasons == []


def test_fa2_mla_shared_memory_model() -> None:
    # DeepSeek dims fit every sm80+ part; a 1024-wide latent does not fit anywhere
    # (q tile alone is 139 KB), matching _fa_common._generated_fa_shared_bytes.
    ds = mla()
    assert fi_caps._fa2_mla_shared_bytes(ds, 233472) == 221728  # H100/H200
    assert fi_caps._fa2_mla_shared_bytes(ds, 102400) <= 101376  # sm86/sm89 opt-in limit
    assert fi_caps._fa2_mla_shared_bytes(ds, 65536) is None
    wide = mla(head_dim=1088, v_head_dim=1024)
    need = fi_caps._fa2_mla_shared_bytes(wide, 233472)
    assert need is not None and need > 232448


# ---------------------------------------------------------------------------------------
# Installed FlashInfer signatures
# ---------------------------------------------------------------------------------------


def _signature_names(owner: Any, method: str) -> set[str]:
    fn = getattr(owner, method)
    params = inspect.signature(fn).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        # BatchDecodeWithPagedKVCacheWrapper.plan(..., **kwargs) forwards to _plan_impl,
        # whose keyword-only parameters are the real, documented options.
        impl = getattr(owner, f"_{method}_impl", None)
        assert impl is not None, f"{owner.__name__}.{method} takes **kwargs; no _{method}_impl"
        names |= set(inspect.signature(impl).parameters)
    return names


@needs_flashinfer
def test_import_flashinfer_and_every_keyword_exists() -> None:
    import flashinfer
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    from flashinfer.mla import MLAPlanMetadata

    from attn_dispatch.backends.flashinfer.backend import WRAPPER_KEYWORDS

    owners = {
        "BatchPrefillWithPagedKVCacheWrapper": flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        "BatchDecodeWithPagedKVCacheWrapper": flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        "MultiLevelCascadeAttentionWrapper": flashinfer.MultiLevelCascadeAttentionWrapper,
        "BatchMLAPagedAttentionWrapper": BatchMLAPagedAttentionWrapper,
        "MLAPlanMetadata": MLAPlanMetadata,
    }
    assert {w for w, _ in WRAPPER_KEYWORDS} == set(owners)
    for (wrapper, method), used in WRAPPER_KEYWORDS.items():
        names = _signature_names(owners[wrapper], method)
        missing = used - names
        assert not missing, f"{wrapper}.{method} has no keyword(s) {sorted(missing)}"


@needs_flashinfer
def test_mla_plan_uses_the_metadata_form_not_the_deprecated_flat_one() -> None:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from attn_dispatch.backends.flashinfer.backend import WRAPPER_KEYWORDS

    plan_kw = WRAPPER_KEYWORDS[("BatchMLAPagedAttentionWrapper", "plan")]
    assert "metadata" in plan_kw
    flat = {"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "block_tables", "seq_lens"}
    assert not plan_kw & flat
    # metadata is keyword-only in the installed wrapper (the preferred form)
    param = inspect.signature(BatchMLAPagedAttentionWrapper.plan).parameters["metadata"]
    assert param.kind is param.KEYWORD_ONLY
    run_kw = WRAPPER_KEYWORDS[("BatchMLAPagedAttentionWrapper", "run")]
    # packed query / cache (plus the FP8 per-tensor scales, the lse request and the caller's
    # output buffer), not the deprecated q_nope/q_pe/ckv_cache/kpe_cache form
    assert run_kw == {
        "query",
        "kv_cache",
        "ckv_scale",
        "kpe_scale",
        "return_lse",
        "return_lse_base_on_e",
        "out",
    }


@needs_flashinfer
def test_variant_and_fp8_keywords_exist_where_the_adapter_passes_them() -> None:
    # The keywords the variants map to, per wrapper, exist in the installed FlashInfer with
    # the meaning the adapter relies on (defaults: no window, no cap, unit scales).
    import flashinfer
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from attn_dispatch.backends.flashinfer.backend import WRAPPER_KEYWORDS

    wanted = {
        ("BatchPrefillWithPagedKVCacheWrapper", "plan"): {"window_left", "logits_soft_cap"},
        ("BatchDecodeWithPagedKVCacheWrapper", "plan"): {"window_left", "logits_soft_cap"},
        ("BatchPrefillWithPagedKVCacheWrapper", "run"): {"k_scale", "v_scale"},
        ("BatchDecodeWithPagedKVCacheWrapper", "run"): {"k_scale", "v_scale"},
        ("BatchMLAPagedAttentionWrapper", "plan"): {"scale_mode"},
        ("BatchMLAPagedAttentionWrapper", "run"): {"ckv_scale", "kpe_scale"},
    }
    owners = {
        "BatchPrefillWithPagedKVCacheWrapper": flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        "BatchDecodeWithPagedKVCacheWrapper": flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        "BatchMLAPagedAttentionWrapper": BatchMLAPagedAttentionWrapper,
    }
    for (wrapper, method), names in wanted.items():
        assert names <= WRAPPER_KEYWORDS[(wrapper, method)], (wrapper, method)
        assert names <= _signature_names(owners[wrapper], method), (wrapper, method)
    decode_plan = inspect.signature(
        flashinfer.BatchDecodeWithPagedKVCacheWrapper._plan_impl
    ).parameters
    assert decode_plan["window_left"].default == -1
    prefill_plan = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan)
    assert prefill_plan.parameters["window_left"].default == -1
    # What is not mapped, and why the capabilities refuse it: the MLA wrapper plans no
    # window and no soft cap.
    mla_plan = _signature_names(BatchMLAPagedAttentionWrapper, "plan")
    assert not {"window_left", "logits_soft_cap"} & mla_plan


# ---------------------------------------------------------------------------------------
# Adapter semantics through recording stand-ins (CPU)
# ---------------------------------------------------------------------------------------


_REAL: dict[str, Any] = {}  # the installed wrapper classes, saved before faking them


def _check_call(wrapper: str, method: str, kwargs: dict[str, Any]) -> None:
    missing = set(kwargs) - _signature_names(_REAL[wrapper], method)
    assert not missing, f"{wrapper}.{method}: {sorted(missing)}"


def _attend_state(
    q: Any, k: Any, v: Any, allowed: Any, scale: float, cap: float = 0.0, dtype: Any = None
) -> tuple[Any, Any]:
    """q [n, H, D], k [m, Hkv, D], v [m, Hkv, Dv], allowed [n, m] -> (out [n, H, Dv], natural
    lse [n, H]) computed in ``dtype`` (fp32 by default); ``cap > 0``: scores cap * tanh(s / cap).
    A row that attends nothing gives out 0 and lse -inf."""
    dtype = dtype or torch.float32
    group = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.to(dtype), k) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, v), torch.logsumexp(s, dim=-1).transpose(0, 1)


def _attend(q: Any, k: Any, v: Any, allowed: Any, scale: float, cap: float = 0.0) -> Any:
    return _attend_state(q, k, v, allowed, scale, cap)[0]


_LOG2E = 1.0 / math.log(2.0)


class _FakeWrapper:
    """Stands in for one FlashInfer wrapper: asserts every call is keyword-only with
    keywords the installed FlashInfer has, and computes attention the way FlashInfer
    defines it (kv_len from page count and last-page fill; causal bottom-right; flat
    per-request [q_len, kv_len] custom mask; lse in base 2 unless asked otherwise)."""

    kind = ""
    made: ClassVar[list[_FakeWrapper]] = []

    def __init__(self, **kwargs: Any) -> None:
        _check_call(self.kind, "__init__", kwargs)
        self.init = kwargs
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        _FakeWrapper.made.append(self)

    def plan(self, **kwargs: Any) -> None:
        _check_call(self.kind, "plan", kwargs)
        for name, value in kwargs.items():
            device_side = ("indices", "paged_kv_indices", "custom_mask")
            if isinstance(value, torch.Tensor) and name not in device_side:
                # host metadata only: FlashInfer would otherwise copy it device -> host
                assert value.device.type == "cpu", name
        self.plans.append(kwargs)

    def run(self, **kwargs: Any) -> Any:
        _check_call(self.kind, "run", kwargs)
        self.runs.append(kwargs)
        out, lse = self._state(self.plans[-1], kwargs)
        dest = kwargs.get("out")
        if dest is not None:  # FlashInfer's out=: written in place and returned
            assert dest.shape == out.shape and dest.dtype == out.dtype and dest.is_contiguous()
            out = dest.copy_(out)
        if not kwargs.get("return_lse"):
            return out
        return out, self._lse_units(self.plans[-1], kwargs, lse)

    def _state(self, p: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        raise NotImplementedError

    def _lse_units(self, p: dict[str, Any], kwargs: dict[str, Any], lse: Any) -> Any:
        return lse * _LOG2E  # FlashInfer's own convention: base 2

    @staticmethod
    def _variants(
        p: dict[str, Any], allowed: Any, kv_len: int, kwargs: dict[str, Any]
    ) -> tuple[Any, float, float, float]:
        """FlashInfer's definitions: window_left >= 0 keeps keys >= q_pos - window_left
        (q_pos bottom-right aligned); logits_soft_cap > 0 caps; k_scale multiplies the
        softmax scale and v_scale the output. Returns (allowed, scale, cap, v_scale)."""
        n = allowed.shape[0]
        window = p.get("window_left", -1)
        if window >= 0:
            q_pos = kv_len - n + torch.arange(n)
            allowed = allowed & (torch.arange(kv_len)[None, :] >= (q_pos - window)[:, None])
        k_scale = kwargs.get("k_scale") or 1.0
        v_scale = kwargs.get("v_scale") or 1.0
        return allowed, p["sm_scale"] * k_scale, p.get("logits_soft_cap") or 0.0, v_scale

    @staticmethod
    def _lens(p: dict[str, Any], page_size: int) -> list[int]:
        paged = "paged_kv_indptr" in p
        indptr = p["paged_kv_indptr" if paged else "indptr"]
        last = p["paged_kv_last_page_len" if paged else "last_page_len"]
        pages = (indptr[1:] - indptr[:-1]).tolist()
        return [max(n - 1, 0) * page_size + int(last[i]) for i, n in enumerate(pages)]


def _prefill_state(p: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """BatchPrefillWithPagedKVCacheWrapper's result for plan ``p``: (out, natural lse)."""
    q = kwargs["q"]
    k_cache, v_cache = kwargs["paged_kv_cache"]
    lens = _FakeWrapper._lens(p, p["page_size"])
    qo = p["qo_indptr"].tolist()
    indptr = p["paged_kv_indptr"].tolist()
    mask = p.get("custom_mask")
    outs, lses, moff = [], [], 0
    for i, kv_len in enumerate(lens):
        pages = p["paged_kv_indices"][indptr[i] : indptr[i + 1]]
        k = k_cache[pages].flatten(0, 1)[:kv_len]
        v = v_cache[pages].flatten(0, 1)[:kv_len]
        n = qo[i + 1] - qo[i]
        if mask is not None:
            allowed = mask[moff : moff + n * kv_len].view(n, kv_len)
            moff += n * kv_len
        elif p["causal"]:
            allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
        else:
            allowed = torch.ones(n, kv_len, dtype=torch.bool)
        allowed, scale, cap, vs = _FakeWrapper._variants(p, allowed, kv_len, kwargs)
        out, lse = _attend_state(q[qo[i] : qo[i + 1]], k, v, allowed, scale, cap)
        outs.append(out * vs)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


class _FakePrefill(_FakeWrapper):
    kind = "BatchPrefillWithPagedKVCacheWrapper"

    def _state(self, p: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return _prefill_state(p, kwargs)

    def _lse_units(self, p: dict[str, Any], kwargs: dict[str, Any], lse: Any) -> Any:
        return lse if kwargs.get("lse_base") == "ln" else lse * _LOG2E


class _FakeDecode(_FakeWrapper):
    kind = "BatchDecodeWithPagedKVCacheWrapper"

    def _state(self, p: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        q = kwargs["q"]
        k_cache, v_cache = kwargs["paged_kv_cache"]
        lens = self._lens(p, p["page_size"])
        indptr = p["indptr"].tolist()
        outs, lses = [], []
        for i, kv_len in enumerate(lens):
            pages = p["indices"][indptr[i] : indptr[i + 1]]
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            every_key = torch.ones(1, kv_len, dtype=torch.bool)
            allowed, scale, cap, vs = self._variants(p, every_key, kv_len, kwargs)
            out, lse = _attend_state(q[i : i + 1], k, v, allowed, scale, cap)
            outs.append(out * vs)
            lses.append(lse)
        return torch.cat(outs).to(q.dtype), torch.cat(lses)


class _FakeCascade(_FakeWrapper):
    """MultiLevelCascadeAttentionWrapper: every level is a paged prefill over all queries
    (causal only in the last level), the levels' states merged (cascade.py: run)."""

    kind = "MultiLevelCascadeAttentionWrapper"

    def run(self, **kwargs: Any) -> Any:
        _check_call(self.kind, "run", kwargs)
        self.runs.append(kwargs)
        p = self.plans[-1]
        levels = len(p["qo_indptr_arr"])
        assert levels == self.init["num_levels"] == 2
        states = []
        for level in range(levels):
            lp = {
                "qo_indptr": p["qo_indptr_arr"][level],
                "paged_kv_indptr": p["paged_kv_indptr_arr"][level],
                "paged_kv_indices": p["paged_kv_indices_arr"][level],
                "paged_kv_last_page_len": p["paged_kv_last_page_len"][level],
                "page_size": p["page_size"],
                "causal": p.get("causal", False) if level == levels - 1 else False,
                "sm_scale": p["sm_scale"],
                "logits_soft_cap": p.get("logits_soft_cap"),
            }
            assert int(lp["qo_indptr"][-1]) == kwargs["q"].shape[0]  # every level, every row
            states.append(_prefill_state(lp, kwargs))
        (o0, l0), (o1, l1) = states
        m = torch.maximum(l0, l1)
        w0, w1 = torch.exp(l0 - m).unsqueeze(-1), torch.exp(l1 - m).unsqueeze(-1)
        return ((o0.float() * w0 + o1.float() * w1) / (w0 + w1)).to(o0.dtype)


class _FakeMLA(_FakeWrapper):
    kind = "BatchMLAPagedAttentionWrapper"

    def run(self, **kwargs: Any) -> Any:
        # FlashInfer fixes the lse mode at plan (_contracts.py: validate_run_options)
        asked = kwargs.get("return_lse") or kwargs.get("return_lse_base_on_e")
        mode = ("basee" if kwargs.get("return_lse_base_on_e") else "base2") if asked else "none"
        if mode != self.plans[-1].get("lse_mode", "none"):
            raise ValueError(f"planned LSE mode {self.plans[-1].get('lse_mode')}, run {mode}")
        return super().run(**kwargs)

    def _lse_units(self, p: dict[str, Any], kwargs: dict[str, Any], lse: Any) -> Any:
        return lse if kwargs.get("return_lse_base_on_e") else lse * _LOG2E

    def _state(self, p: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        md = p["metadata"]
        # FlashInfer's CSR rule: exactly ceil(kv_len / page_size) pages per request
        need = (md.kv_len_arr + p["page_size"] - 1) // p["page_size"]
        assert torch.equal(md.kv_indptr[1:] - md.kv_indptr[:-1], need)
        q, cache = kwargs["query"], kwargs["kv_cache"]
        ckv = p["head_dim_ckv"]
        assert q.shape[-1] == cache.shape[-1] == ckv + p["head_dim_kpe"]
        qo, indptr = md.qo_indptr.tolist(), md.kv_indptr.tolist()
        outs, lses = [], []
        for i, kv_len in enumerate(md.kv_len_arr.tolist()):
            pages = md.kv_indices[indptr[i] : indptr[i + 1]]
            k = cache[pages].flatten(0, 1)[:kv_len].unsqueeze(1).float()
            if p.get("scale_mode") == "kv-per-tensor":
                # FP8 latent: ckv part times ckv_scale, rope part times kpe_scale
                k = torch.cat(
                    [k[..., :ckv] * kwargs["ckv_scale"], k[..., ckv:] * kwargs["kpe_scale"]], -1
                )
            else:
                assert "ckv_scale" not in kwargs and "kpe_scale" not in kwargs
            n = qo[i + 1] - qo[i]
            if p["causal"]:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
            else:
                allowed = torch.ones(n, kv_len, dtype=torch.bool)
            out, lse = _attend_state(q[qo[i] : qo[i + 1]], k, k[..., :ckv], allowed, p["sm_scale"])
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs).to(q.dtype), torch.cat(lses)


def _reference_state(
    cfg: AttnConfig,
    batch: Any,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype: Any = None,
    **overrides: Any,
) -> tuple[Any, Any]:
    """Our contract: the float64 oracle (tests/oracle.py) on this config and batch, read
    independently of the adapter's page-table code, as (out, natural lse) rounded to
    ``dtype`` (fp32 by default, what the stand-ins compute in); ``overrides`` replace the
    oracle's keywords (``causal=True`` reads a non-causal config as causal)."""
    out, lse = oracle.reference_state_for_batch(
        cfg, batch, q, k_cache, v_cache, scale, k_scale=k_scale, v_scale=v_scale, **overrides
    )
    dtype = dtype or torch.float32
    return out.to(dtype), lse.to(dtype)


def _reference(
    cfg: AttnConfig,
    batch: Any,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    **overrides: Any,
) -> Any:
    return _reference_state(cfg, batch, q, k_cache, v_cache, scale, k_scale, v_scale, **overrides)[
        0
    ]


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Any:
    if not HAS_FLASHINFER:
        pytest.skip("flashinfer-python not installed")
    import flashinfer
    import flashinfer.mla

    from attn_dispatch.backends.flashinfer import backend as fb

    _REAL.update(
        BatchPrefillWithPagedKVCacheWrapper=flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        BatchDecodeWithPagedKVCacheWrapper=flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        BatchMLAPagedAttentionWrapper=flashinfer.mla.BatchMLAPagedAttentionWrapper,
        MultiLevelCascadeAttentionWrapper=flashinfer.MultiLevelCascadeAttentionWrapper,
    )
    monkeypatch.setattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", _FakePrefill)
    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", _FakeDecode)
    monkeypatch.setattr(flashinfer, "MultiLevelCascadeAttentionWrapper", _FakeCascade)
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", _FakeMLA)
    # the machine has no GPU: run the adapter's host logic on CPU tensors
    monkeypatch.setattr(fb, "_device_for", lambda config: torch.device("cpu"))
    monkeypatch.setattr(fb, "_check_config", lambda config: None)
    monkeypatch.setattr(fb, "_check_phase", lambda config, phase: None)
    # the stand-ins compute in fp32: the 16-bit configs run on fp32 tensors here
    monkeypatch.setattr(fb, "_DTYPES", {"float16": torch.float32, "bfloat16": torch.float32})
    monkeypatch.setattr(fb, "_KV_DTYPES", {**fb._KV_DTYPES, **fb._DTYPES})
    _FakeWrapper.made = []
    return fb


def _batch(
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    spare: list[int] | None = None,
    mask: Any = None,
) -> Any:
    """A batch whose pages are scattered, with ``spare[i]`` unused pages after request
    i's needed ones (a pool that reserves ahead)."""
    spare = spare or [0] * len(kv_lens)
    counts = [math.ceil(n / page_size) + s for n, s in zip(kv_lens, spare, strict=True)]
    total = sum(counts)
    gen = torch.Generator().manual_seed(len(kv_lens) * 7 + total)
    perm = torch.randperm(total + 3, generator=gen)[:total].to(torch.int32)
    return _make_batch(phase, q_lens, kv_lens, counts, perm, mask)


def _make_batch(
    phase: Phase, q_lens: list[int], kv_lens: list[int], counts: list[int], indices: Any, mask: Any
) -> Any:
    from attn_dispatch import AttnBatch

    def indptr(xs: list[int]) -> Any:
        return torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)

    return AttnBatch(
        phase=phase,
        qo_indptr=indptr(q_lens),
        kv_indptr=indptr(counts),
        kv_indices=indices,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        custom_mask=mask,
    )


def _caches(cfg: AttnConfig, num_pages: int, gen: Any) -> tuple[Any, Any]:
    dt = torch.float32  # the stand-ins compute in fp32; dtype plumbing is checked apart
    if cfg.kind == "mla":
        return torch.randn(num_pages, cfg.page_size, cfg.head_dim, generator=gen, dtype=dt), None
    shape = (num_pages, cfg.page_size, cfg.num_kv_heads)
    k = torch.randn(*shape, cfg.head_dim, generator=gen, dtype=dt)
    v = torch.randn(*shape, cfg.v_head_dim, generator=gen, dtype=dt)
    return k, v


@pytest.mark.parametrize(
    ("cfg", "phase", "q_lens", "kv_lens", "spare", "route"),
    [
        (
            mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4),
            Phase.PREFILL,
            [3, 5],
            [7, 5],
            [0, 2],
            "BatchPrefillWithPagedKVCacheWrapper",
        ),
        (
            mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4),
            Phase.DECODE,
            [1, 1, 1],
            [9, 1, 4],
            [1, 0, 0],
            "BatchDecodeWithPagedKVCacheWrapper",
        ),
        (
            mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4),
            Phase.VERIFY,
            [3, 3],
            [8, 6],
            [0, 0],
            "BatchPrefillWithPagedKVCacheWrapper",
        ),
        (
            mha(num_q_heads=2, num_kv_heads=1, head_dim=192, v_head_dim=128, page_size=2),
            Phase.DECODE,
            [1, 1],
            [3, 4],
            [0, 1],
            "BatchPrefillWithPagedKVCacheWrapper",
        ),
        (
            mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4),
            Phase.DECODE,
            [1, 1],
            [5, 8],
            [2, 0],
            "BatchMLAPagedAttentionWrapper",
        ),
        (
            mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4),
            Phase.VERIFY,
            [2, 3],
            [5, 8],
            [0, 1],
            "BatchMLAPagedAttentionWrapper",
        ),
        (
            mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4),
            Phase.PREFILL,
            [5, 2],
            [5, 9],
            [0, 0],
            "BatchMLAPagedAttentionWrapper",
        ),
    ],
)
def test_adapter_matches_contract(
    fake_flashinfer: Any,
    cfg: AttnConfig,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    spare: list[int],
    route: str,
) -> None:
    batch = _batch(phase, q_lens, kv_lens, cfg.page_size, spare)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=scale)
    handler = backend.handler(phase)
    plan = backend.plan(batch)
    assert plan.owner is backend and plan.snap.num_tokens == batch.num_tokens
    out = handler(q, k_cache, v_cache, plan, scale)
    assert [w.kind for w in _FakeWrapper.made] == [route]
    assert out.shape == (sum(q_lens), cfg.num_q_heads, cfg.v_head_dim)
    torch.testing.assert_close(out, _reference(cfg, batch, q, k_cache, v_cache, scale))
    wrapper = _FakeWrapper.made[0]
    assert len(wrapper.plans) == 1  # one plan per forward
    if cfg.kind == "mla":
        # a single query token is planned non-causal (clear of the causal tile rule)
        assert wrapper.plans[0]["causal"] is (max(q_lens) > 1)
        # its default policy: decompressed only for prefill without a cached prefix
        prefix = int(batch.kv_lens_host.sum()) - batch.num_tokens
        no_prefix_prefill = batch.phase is Phase.PREFILL and prefix == 0
        want = AttnForm.MHA if no_prefix_prefill else AttnForm.MLA
        assert fi_caps.DEFAULT_FORM_POLICY.choose(batch) is want


@pytest.mark.parametrize(
    ("phase", "q_lens", "kv_lens", "route"),
    [
        (Phase.PREFILL, [3, 5], [11, 5], "BatchPrefillWithPagedKVCacheWrapper"),
        (Phase.DECODE, [1, 1, 1], [9, 1, 14], "BatchDecodeWithPagedKVCacheWrapper"),
    ],
)
@pytest.mark.parametrize(("window", "cap"), [(None, None), (3, None), (0, 2.0), (50, 1.5)])
def test_adapter_maps_window_and_soft_cap(
    fake_flashinfer: Any,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    route: str,
    window: int | None,
    cap: float | None,
) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4,
              window_left=window, logit_cap=cap)  # fmt: skip
    batch = _batch(phase, q_lens, kv_lens, cfg.page_size)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen) * 3
    scale = 1.0 / math.sqrt(cfg.head_dim)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=scale)
    out = backend.handler(phase)(q, k_cache, v_cache, backend.plan(batch), scale)
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == route
    # FlashInfer's spelling of "no window" and "no cap"
    assert wrapper.plans[0]["window_left"] == (-1 if window is None else window)
    assert wrapper.plans[0]["logits_soft_cap"] == (cap or 0.0)
    torch.testing.assert_close(out, _reference(cfg, batch, q, k_cache, v_cache, scale))


def test_adapter_maps_window_with_a_verify_tree(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=2, num_kv_heads=1, head_dim=64, v_head_dim=64, page_size=2,
              tree_verify=True, window_left=2, logit_cap=4.0)  # fmt: skip
    q_lens, kv_lens = [3, 2], [7, 4]
    blocks = []
    gen = torch.Generator().manual_seed(8)
    for n, m in zip(q_lens, kv_lens, strict=True):
        block = torch.ones(n, m, dtype=torch.bool)
        block[:, m - n :] = (torch.rand(n, n, generator=gen) < 0.5) | torch.eye(n, dtype=torch.bool)
        blocks.append(block.reshape(-1))
    batch = _batch(Phase.VERIFY, q_lens, kv_lens, cfg.page_size, mask=torch.cat(blocks))
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(sum(q_lens), 2, 64, generator=gen)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    out = backend.handler(Phase.VERIFY)(q, k_cache, v_cache, backend.plan(batch), 0.125)
    planned = _FakeWrapper.made[0].plans[0]
    # the window is folded into the mask (a node's own sequence), not applied by position
    assert planned["window_left"] == -1
    assert int(planned["custom_mask"].sum()) < int(batch.custom_mask.sum())
    torch.testing.assert_close(out, _reference(cfg, batch, q, k_cache, v_cache, 0.125))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize(
    ("kind", "phase", "route"),
    [
        ("mha", Phase.PREFILL, "BatchPrefillWithPagedKVCacheWrapper"),
        ("mha", Phase.DECODE, "BatchDecodeWithPagedKVCacheWrapper"),
        ("mla", Phase.DECODE, "BatchMLAPagedAttentionWrapper"),
    ],
)
def test_adapter_passes_fp8_scales(
    fake_flashinfer: Any, fmt: str, kind: str, phase: Phase, route: str
) -> None:
    if kind == "mha":
        cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4,
                  kv_dtype=fmt)  # fmt: skip
    else:
        cfg = mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4, kv_dtype=fmt)
    q_lens = [1, 1] if phase is Phase.DECODE else [3, 2]
    batch = _batch(phase, q_lens, [9, 6], cfg.page_size)
    gen = torch.Generator().manual_seed(6)
    k16, v16 = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    k_cache = k16.to(getattr(torch, fmt))
    v_cache = None if v16 is None else v16.to(getattr(torch, fmt))
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=scale)
    plan = backend.plan(batch)
    scales = {"k_scale": 0.5} if kind == "mla" else {"k_scale": 0.5, "v_scale": 3.0}
    out = backend.handler(phase)(q, k_cache, v_cache, plan, scale, **scales)
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == route
    assert wrapper.plans[0]["kv_data_type"] == getattr(torch, fmt)
    if kind == "mla":
        assert wrapper.plans[0]["scale_mode"] == "kv-per-tensor"
    v_scale = 0.5 if kind == "mla" else 3.0
    want = _reference(cfg, batch, q, k_cache, v_cache, scale, k_scale=0.5, v_scale=v_scale)
    torch.testing.assert_close(out, want)
    # a scale on a 16-bit config is refused, naming it
    plain = fake_flashinfer.FlashInferBackend(cfg.replace(kv_dtype=cfg.dtype), sm_scale=scale)
    with pytest.raises(InvalidBatchError) as err:
        plain.handler(phase)(q, k16, v16, plain.plan(batch), scale, k_scale=0.5)
    assert err.value.field == "k_scale"


def test_capabilities_declare_exactly_the_mapped_variants() -> None:
    from attn_dispatch.backends.flashinfer import CAPABILITIES

    def reasons(cfg: AttnConfig, phase: Phase = Phase.DECODE) -> str:
        return " | ".join(CAPABILITIES.reasons(cfg, phase))

    for phase in Phase:
        # "lse" once the core's vocabulary has it (AttnConfig.return_lse)
        lse = {"lse"} & set(VARIANTS)
        assert CAPABILITIES.variants_for(phase) == {"window", "logit_cap", "non_causal", *lse}
    base = mha(num_q_heads=8, num_kv_heads=1, head_dim=64, v_head_dim=64)
    assert "sinks" not in reasons(base.replace(window_left=127, logit_cap=30.0))
    assert "window" not in reasons(base.replace(window_left=127))
    assert "trtllm-gen" in reasons(base.replace(sinks=True))  # says why, not only "no"
    # MLA: the wrapper plans neither a window nor a cap
    m = mla()
    assert "window_left" in reasons(m.replace(window_left=10))
    assert "logit_cap" in reasons(m.replace(logit_cap=5.0), Phase.PREFILL)
    # FP8: both formats for MHA; MLA only e4m3fn bf16 512/64 (fa2/fa3 plan rule)
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        assert "FP8" not in reasons(base.replace(kv_dtype=fmt))
        assert "kv_dtype" not in reasons(base.replace(kv_dtype=fmt))
    assert "FP8" not in reasons(m.replace(kv_dtype="float8_e4m3fn"))
    assert "FP8 latent" in reasons(m.replace(kv_dtype="float8_e5m2"))
    assert "FP8 latent" in reasons(m.replace(kv_dtype="float8_e4m3fn", dtype="float16"))
    odd = mla(head_dim=192, v_head_dim=128, kv_dtype="float8_e4m3fn")
    assert "FP8 latent" in reasons(odd)


def test_tree_verify_mask_passes_through(fake_flashinfer: Any) -> None:
    cfg = mha(
        num_q_heads=2, num_kv_heads=1, head_dim=64, v_head_dim=64, page_size=2, tree_verify=True
    )
    q_lens, kv_lens = [3, 2], [6, 4]
    gen = torch.Generator().manual_seed(3)
    blocks = []
    for n, m in zip(q_lens, kv_lens, strict=True):
        block = torch.ones(n, m, dtype=torch.bool)
        tree = torch.rand(n, n, generator=gen) < 0.5
        block[:, m - n :] = tree | torch.eye(n, dtype=torch.bool)
        blocks.append(block.reshape(-1))
    mask = torch.cat(blocks)
    batch = _batch(Phase.VERIFY, q_lens, kv_lens, cfg.page_size, [1, 0], mask=mask)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(sum(q_lens), 2, 64, generator=gen)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    out = backend.handler(Phase.VERIFY)(q, k_cache, v_cache, backend.plan(batch), 0.125)
    plan_kw = _FakeWrapper.made[0].plans[0]
    assert plan_kw["causal"] is False and plan_kw["custom_mask"] is not None
    torch.testing.assert_close(out, _reference(cfg, batch, q, k_cache, v_cache, 0.125))
    # the mask changes the answer (so the check above is not vacuous)
    causal = _batch(Phase.VERIFY, q_lens, kv_lens, cfg.page_size, [1, 0])
    assert not torch.allclose(out, _reference(cfg, causal, q, k_cache, v_cache, 0.125))


def test_mla_refuses_a_masked_verify_batch(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidBatchError

    cfg = mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg)
    batch = _batch(Phase.VERIFY, [2], [5], 4, mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(InvalidBatchError, match="custom_mask"):
        backend.plan(batch)


def test_scale_is_planned_once_and_another_scale_is_refused(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidBatchError

    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg)  # no scale given: 1/sqrt(head_dim)
    handler = backend.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [1, 1], [5, 3], 4)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(2, 2, 64, generator=gen)
    plan = backend.plan(batch)
    wrapper = _FakeWrapper.made[0]
    assert wrapper.plans[0]["sm_scale"] == pytest.approx(1 / 8)
    for _layer in range(3):
        out = handler(q, k_cache, v_cache, plan, 1 / 8)
    torch.testing.assert_close(out, _reference(cfg, batch, q, k_cache, v_cache, 1 / 8))
    with pytest.raises(InvalidBatchError, match="differs from the planned") as err:
        handler(q, k_cache, v_cache, plan, 0.3)
    assert err.value.field == "sm_scale"
    assert len(wrapper.plans) == 1  # never re-planned inside the layer loop


def test_scale_comes_from_the_config(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidSpecError

    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    cfg = cfg.replace(sm_scale=0.3)
    backend = fake_flashinfer.FlashInferBackend(cfg)
    backend.handler(Phase.DECODE)
    backend.plan(_batch(Phase.DECODE, [1], [3], 4))
    assert _FakeWrapper.made[0].plans[0]["sm_scale"] == 0.3
    with pytest.raises(InvalidSpecError, match="sm_scale"):
        fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.2)


def test_plans_are_owned_and_a_superseded_plan_is_refused(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidBatchError

    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    mine = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    other = fake_flashinfer.FlashInferBackend(cfg.replace(page_size=2), sm_scale=0.125)
    run = mine.handler(Phase.DECODE)
    other.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [1, 1], [5, 3], 4)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(2, 2, 64, generator=gen)
    small = _batch(Phase.DECODE, [1, 1], [2, 1], 2)
    with pytest.raises(InvalidBatchError, match="another FlashInferBackend") as err:
        run(q, k_cache, v_cache, other.plan(small), 0.125)
    assert err.value.field == "plan"
    first = mine.plan(batch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.sm_scale = 0.3  # type: ignore[misc]
    mine.plan(batch)  # re-plans the same wrapper
    with pytest.raises(InvalidBatchError, match="superseded"):
        run(q, k_cache, v_cache, first, 0.125)


def test_edits_after_plan_do_not_reach_flashinfer(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    run = backend.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [1, 1], [5, 3], 4)
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(2, 2, 64, generator=gen)
    want = _reference(cfg, batch, q, k_cache, v_cache, 0.125)
    plan = backend.plan(batch)
    batch.kv_indices.fill_(-1)
    batch.kv_lens.fill_(1)
    torch.testing.assert_close(run(q, k_cache, v_cache, plan, 0.125), want)


def test_decode_tensor_cores_follow_the_group_size(fake_flashinfer: Any) -> None:
    made = {}
    for hq, hkv in [(8, 8), (8, 4), (32, 8), (40, 8), (10, 2)]:
        cfg = mha(num_q_heads=hq, num_kv_heads=hkv, head_dim=64, v_head_dim=64, page_size=4)
        backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
        backend.handler(Phase.DECODE)
        backend.plan(_batch(Phase.DECODE, [1], [3], 4))
        made[hq // hkv] = _FakeWrapper.made[-1].init["use_tensor_cores"]
    # groups 1, 2 use CUDA cores; 4, 5 (not built for CUDA cores) and larger use tensor cores
    assert made == {1: False, 2: False, 4: True, 5: True}


def test_cuda_graph_mode_keeps_persistent_buffers_per_batch_size(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidBatchError
    from attn_dispatch import InvalidSpecError

    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    with pytest.raises(InvalidSpecError, match="max_num_pages"):
        fake_flashinfer.FlashInferBackend(cfg, use_cuda_graph=True)
    backend = fake_flashinfer.FlashInferBackend(
        cfg, use_cuda_graph=True, max_num_pages=64, max_batch_size=4, sm_scale=0.125
    )
    backend.handler(Phase.DECODE)
    for kv in ([5, 3], [9, 2], [4, 4, 4]):
        backend.plan(_batch(Phase.DECODE, [1] * len(kv), kv, 4))
    sizes = [len(w.init["paged_kv_last_page_len_buffer"]) for w in _FakeWrapper.made]
    assert sizes == [2, 3]  # one wrapper per batch size, re-planned in place
    assert all(w.init["use_cuda_graph"] is True for w in _FakeWrapper.made)
    indices = {id(w.init["paged_kv_indices_buffer"]) for w in _FakeWrapper.made}
    assert indices == {id(backend.graph_indices)}  # one persistent index buffer
    with pytest.raises(InvalidBatchError, match="max_batch_size"):
        backend.plan(_batch(Phase.DECODE, [1] * 5, [1] * 5, 4))


def test_too_few_pages_is_an_invalid_batch(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidBatchError

    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    backend.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [1, 1], [5, 3], 4, spare=[-1, 0])
    with pytest.raises(InvalidBatchError, match="request 0"):
        backend.plan(batch)


def test_workspace_is_owned_per_backend_object(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    a = fake_flashinfer.FlashInferBackend(cfg, workspace_bytes=1024)
    b = fake_flashinfer.FlashInferBackend(cfg, workspace_bytes=1024)
    assert a.workspace.data_ptr() != b.workspace.data_ptr()
    a.handler(Phase.PREFILL)
    a.handler(Phase.DECODE)
    a.plan(_batch(Phase.PREFILL, [2], [2], 4))
    a.plan(_batch(Phase.DECODE, [1], [3], 4))
    assert all(w.init["float_workspace_buffer"] is a.workspace for w in _FakeWrapper.made)


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.VERIFY])
def test_non_causal_layers_are_planned_non_causal(fake_flashinfer: Any, phase: Phase) -> None:
    """AttnConfig(causal=False) (encoder layers): FlashInfer's prefill planned with
    causal=False, every key of the request attended (checked against our contract read with
    an all-True mask)."""
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4,
              causal=False)  # fmt: skip
    q_lens, kv_lens = [3, 5], [11, 5]
    batch = _batch(phase, q_lens, kv_lens, cfg.page_size)
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    out = backend.handler(phase)(q, k_cache, v_cache, backend.plan(batch), 0.125)
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == "BatchPrefillWithPagedKVCacheWrapper"
    assert wrapper.plans[0]["causal"] is False
    every = torch.ones(sum(n * m for n, m in zip(q_lens, kv_lens, strict=True)), dtype=torch.bool)
    full = _batch(phase, q_lens, kv_lens, cfg.page_size, mask=every)
    expected = _reference(cfg, full, q, k_cache, v_cache, 0.125)
    torch.testing.assert_close(out, expected)
    causal = _reference(cfg, batch, q, k_cache, v_cache, 0.125, causal=True)
    assert not torch.allclose(out, causal)  # the check can tell the two apart


# ---------------------------------------------------------------------------------------
# LSE (return_lse=True): the flag reaches FlashInfer, its units become natural log
# ---------------------------------------------------------------------------------------


def _with_lse(cfg: AttnConfig, fb: Any, monkeypatch: pytest.MonkeyPatch) -> AttnConfig:
    """``cfg`` with ``return_lse=True``."""
    return cfg.replace(return_lse=True)


_LSE_CASES = [
    # (kind, phase, q_lens, kv_lens, extra config, fp8 scales, route)
    ("mha", Phase.PREFILL, [3, 5], [7, 5], {}, None, "BatchPrefillWithPagedKVCacheWrapper"),
    ("mha", Phase.VERIFY, [3, 2], [9, 6], {"logit_cap": 2.0}, None,
     "BatchPrefillWithPagedKVCacheWrapper"),
    ("mha", Phase.DECODE, [1, 1, 1], [9, 1, 14], {}, None, "BatchDecodeWithPagedKVCacheWrapper"),
    ("mha", Phase.DECODE, [1, 1], [9, 14], {"window_left": 3, "logit_cap": 1.5}, None,
     "BatchDecodeWithPagedKVCacheWrapper"),
    ("mha", Phase.DECODE, [1, 1], [9, 6], {"kv_dtype": "float8_e4m3fn"}, (0.5, 3.0),
     "BatchDecodeWithPagedKVCacheWrapper"),
    ("mha", Phase.PREFILL, [3, 2], [9, 6], {"kv_dtype": "float8_e5m2"}, (2.0, 0.25),
     "BatchPrefillWithPagedKVCacheWrapper"),
    ("mha192", Phase.DECODE, [1, 1], [3, 4], {}, None, "BatchPrefillWithPagedKVCacheWrapper"),
    ("mla", Phase.DECODE, [1, 1], [5, 8], {}, None, "BatchMLAPagedAttentionWrapper"),
    ("mla", Phase.VERIFY, [2, 3], [5, 8], {}, None, "BatchMLAPagedAttentionWrapper"),
]  # fmt: skip


def _lse_config(kind: str, extra: dict[str, Any]) -> AttnConfig:
    if kind == "mla":
        return mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4, **extra)
    if kind == "mha192":
        return mha(num_q_heads=2, num_kv_heads=1, head_dim=192, v_head_dim=128, page_size=2)
    return mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4, **extra)


@pytest.mark.parametrize(
    ("kind", "phase", "q_lens", "kv_lens", "extra", "scales", "route"), _LSE_CASES
)
def test_return_lse_reaches_flashinfer_and_comes_back_as_natural_log(
    fake_flashinfer: Any,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    extra: dict[str, Any],
    scales: tuple[float, float] | None,
    route: str,
) -> None:
    """The stand-ins answer in FlashInfer's units (base 2 unless asked for ln); the adapter's
    lse must equal the contract's natural-log lse computed in float64, scores after scale,
    FP8 k_scale and cap."""
    fb = fake_flashinfer
    cfg = _with_lse(_lse_config(kind, extra), fb, monkeypatch)
    batch = _batch(phase, q_lens, kv_lens, cfg.page_size)
    gen = torch.Generator().manual_seed(21)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    if cfg.kv_dtype != cfg.dtype:
        fp8 = getattr(torch, str(cfg.kv_dtype))
        k_cache = k_cache.to(fp8)
        v_cache = None if v_cache is None else v_cache.to(fp8)
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen) * 2
    scale = 1.0 / math.sqrt(cfg.head_dim)
    backend = fb.FlashInferBackend(cfg, sm_scale=scale)
    run = backend.handler(phase)
    plan = backend.plan(batch)
    kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    out, lse = run(q, k_cache, v_cache, plan, scale, return_lse=True, **kw)
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == route and plan.cascade is None
    called = wrapper.runs[-1]
    assert called["return_lse"] is True
    if route == "BatchPrefillWithPagedKVCacheWrapper":
        assert called["lse_base"] == "ln"  # FlashInfer converts
    if route == "BatchMLAPagedAttentionWrapper":
        assert wrapper.plans[0]["lse_mode"] == "basee" and called["return_lse_base_on_e"] is True
    assert lse.dtype == torch.float32 and lse.shape == (sum(q_lens), cfg.num_q_heads)
    assert lse.is_contiguous()
    ks, vs = scales or (1.0, 1.0)
    if kind == "mla":
        vs = ks
    want_out, want_lse = _reference_state(
        cfg, batch, q, k_cache, v_cache, scale, ks, vs, dtype=torch.float64
    )
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-4)
    # base 2 would be wrong by a factor log2(e): the check tells the units apart
    assert not torch.allclose(lse.double() * _LOG2E, want_lse, atol=1e-3)


def test_lse_is_not_requested_unless_asked(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    run = backend.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [1, 1], [5, 3], 4)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    out = run(q, k_cache, v_cache, backend.plan(batch), 0.125)
    assert isinstance(out, torch.Tensor)
    assert "return_lse" not in _FakeWrapper.made[0].runs[-1]


def test_mla_lse_mode_is_planned_and_every_run_matches_it(
    fake_flashinfer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlashInfer's MLA wrapper refuses a run whose lse mode differs from the plan's: a
    config with return_lse plans ``basee`` and a call without lse still runs in that mode
    (the lse dropped); a config without it refuses ``return_lse=True`` by name."""
    fb = fake_flashinfer
    plain_cfg = mla(num_q_heads=2, head_dim=192, v_head_dim=128, page_size=4)
    batch = _batch(Phase.DECODE, [1, 1], [5, 8], 4)
    gen = torch.Generator().manual_seed(3)
    cache, _ = _caches(plain_cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(2, 2, 192, generator=gen)
    plain = fb.FlashInferBackend(plain_cfg, sm_scale=0.1)
    plan = plain.plan(batch)
    with pytest.raises(InvalidBatchError, match="return_lse=True") as err:
        plain.handler(Phase.DECODE)(q, cache, None, plan, 0.1, return_lse=True)
    assert err.value.field == "return_lse"
    assert "lse_mode" not in _FakeWrapper.made[0].plans[0]
    cfg = _with_lse(plain_cfg, fb, monkeypatch)
    backend = fb.FlashInferBackend(cfg, sm_scale=0.1)
    plan = backend.plan(batch)
    out = backend.handler(Phase.DECODE)(q, cache, None, plan, 0.1)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, _reference(cfg, batch, q, cache, None, 0.1))
    assert _FakeWrapper.made[-1].runs[-1]["return_lse_base_on_e"] is True


def test_idle_forward_returns_empty_out_and_lse(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    run = backend.handler(Phase.DECODE)
    batch = _batch(Phase.DECODE, [], [], 4)
    k_cache, v_cache = _caches(cfg, 2, torch.Generator().manual_seed(0))
    out, lse = run(torch.zeros(0, 4, 64), k_cache, v_cache, backend.plan(batch), 0.125,
                   return_lse=True)  # fmt: skip
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4) and lse.dtype == torch.float32


def test_merging_two_halves_of_the_pages_equals_attention_over_all(fake_flashinfer: Any) -> None:
    """Decode over the first pages and over the rest of each request (disjoint key sets),
    merged by their lse, equals decode over all keys (the contract's purpose of lse)."""
    from attn_dispatch import AttnBatch
    from attn_dispatch import merge_state

    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4,
              logit_cap=3.0)  # fmt: skip
    ps, kv_lens, split = 4, [13, 22, 9], [2, 3, 1]  # pages in the first part
    batch = _batch(Phase.DECODE, [1, 1, 1], kv_lens, ps)
    pages = [
        batch.kv_indices[batch.kv_indptr[i] : batch.kv_indptr[i + 1]].tolist() for i in range(3)
    ]
    first = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * 3, kv_lens=[s * ps for s in split],
        page_tables=[p[:s] for p, s in zip(pages, split, strict=True)], page_size=ps,
    )  # fmt: skip
    rest = AttnBatch.build(
        Phase.DECODE, q_lens=[1] * 3,
        kv_lens=[n - s * ps for n, s in zip(kv_lens, split, strict=True)],
        page_tables=[p[s:] for p, s in zip(pages, split, strict=True)], page_size=ps,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(3, 4, 64, generator=gen) * 2
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125, cascade=False)
    run = backend.handler(Phase.DECODE)
    out_a, lse_a = run(q, k_cache, v_cache, backend.plan(first), 0.125, return_lse=True)
    out_b, lse_b = run(q, k_cache, v_cache, backend.plan(rest), 0.125, return_lse=True)
    out, lse = merge_state(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = _reference_state(cfg, batch, q, k_cache, v_cache, 0.125,
                                          dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Cascade: shared leading pages read once through MultiLevelCascadeAttentionWrapper
# ---------------------------------------------------------------------------------------


def test_cascade_groups_finds_shared_leading_pages() -> None:
    from attn_dispatch.backends.flashinfer.backend import cascade_groups

    def groups(q: list[int], kv: list[int], tables: list[list[int]], ps: int) -> Any:
        indptr = [0, *torch.tensor([len(t) for t in tables]).cumsum(0).tolist()]
        return cascade_groups(q, kv, indptr, [p for t in tables for p in t], ps)

    # all share two pages; the third page differs per request
    assert groups([1, 1, 1], [12, 11, 10], [[4, 5, 6], [4, 5, 7], [4, 5, 8]], 4) == [(0, 3, 2)]
    # shared whole pages stop before a request's first query: 8 keys, 1 query -> 1 page
    assert groups([1, 1], [8, 8], [[4, 5], [4, 5]], 4) == [(0, 2, 1)]
    # ... and a 4-token verify chain on 8 keys leaves 1 page before its queries
    assert groups([4, 4], [9, 9], [[4, 5, 6], [4, 5, 6]], 4) == [(0, 2, 1)]
    # the same page ids at other positions are not a shared prefix
    assert groups([1, 1], [12, 12], [[4, 5, 6], [9, 4, 5]], 4) == [(0, 1, 0), (1, 2, 0)]
    # partly shared: a request sharing one page with the next three, which share four more
    tables = [[1, 2, 3], [1, 5, 6, 7, 8, 10], [1, 5, 6, 7, 8, 11], [1, 5, 6, 7, 8, 12]]
    assert groups([1] * 4, [9, 21, 21, 21], tables, 4) == [(0, 1, 0), (1, 4, 5)]
    # two runs (a break between requests 1 and 2) and one group each
    tables = [[1, 2, 9], [1, 2, 8], [3, 4, 7], [3, 4, 6]]
    assert groups([1] * 4, [12] * 4, tables, 4) == [(0, 2, 2), (2, 4, 2)]


def _shared_batch(
    phase: Phase, q_lens: list[int], kv_lens: list[int], tables: list[list[int]], ps: int
) -> Any:
    from attn_dispatch import AttnBatch

    return AttnBatch.build(phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables,
                           page_size=ps)  # fmt: skip


# page 4; requests 0-2 share pages [10, 11] (0 and 1 share three: a smaller group would save
# less), request 3 shares nothing: level 0 gets its first page alone.
_TABLES = [[10, 11, 12, 20, 21], [10, 11, 12, 30], [10, 11, 40, 41, 42], [50, 51, 52]]
_KV = [17, 14, 18, 9]


def _run_both(
    fb: Any, cfg: AttnConfig, batch: Any, scale: float = 0.125, **options: Any
) -> tuple[Any, Any, Any, Any]:
    """(cascade plan, its output, the plain plan's output, q/k/v) for ``batch``."""
    gen = torch.Generator().manual_seed(17)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(batch.num_tokens, cfg.num_q_heads, cfg.head_dim, generator=gen) * 2
    backend = fb.FlashInferBackend(cfg, sm_scale=scale, **options)
    plan = backend.plan(batch)
    out = backend.handler(batch.phase)(q, k_cache, v_cache, plan, scale)
    plain = fb.FlashInferBackend(cfg, sm_scale=scale, cascade=False)
    plain_out = plain.handler(batch.phase)(q, k_cache, v_cache, plain.plan(batch), scale)
    return plan, out, plain_out, (q, k_cache, v_cache)


def test_cascade_levels_hold_the_shared_and_own_pages(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4,
              logit_cap=5.0)  # fmt: skip
    batch = _shared_batch(Phase.DECODE, [1] * 4, _KV, _TABLES, 4)
    plan, out, plain_out, (q, k, v) = _run_both(fake_flashinfer, cfg, batch)
    assert plan.cascade is not None
    assert plan.cascade.groups == ((0, 3),) and plan.cascade.shared_pages == (2,)
    assert plan.cascade.saved_tokens == 16 and plan.cascade.total_tokens == sum(_KV)
    assert "1 group (3 requests) shares 8 tokens" in str(plan.cascade)
    assert plan.dispatch_note == f"cascade: {plan.cascade}"  # what record_dispatch shows
    cascade = _FakeWrapper.made[0]
    assert cascade.kind == "MultiLevelCascadeAttentionWrapper"
    p = cascade.plans[0]

    def ints(ts: list[Any]) -> list[list[int]]:
        return [t.tolist() for t in ts]

    assert ints(p["qo_indptr_arr"]) == [[0, 3, 4], [0, 1, 2, 3, 4]]
    assert ints(p["paged_kv_indptr_arr"]) == [[0, 2, 3], [0, 3, 5, 8, 10]]
    own = [12, 20, 21, 12, 30, 40, 41, 42, 51, 52]
    assert ints(p["paged_kv_indices_arr"]) == [[10, 11, 50], own]
    assert ints(p["paged_kv_last_page_len"]) == [[4, 4], [1, 2, 2, 1]]
    assert p["logits_soft_cap"] == 5.0 and p["sm_scale"] == 0.125 and p["causal"] is True
    assert cascade.init["num_levels"] == 2 and cascade.init["kv_layout"] == "NHD"
    # the plain path ran the decode wrapper and gives the same answer (and the contract's)
    assert _FakeWrapper.made[1].kind == "BatchDecodeWithPagedKVCacheWrapper"
    torch.testing.assert_close(out, plain_out)
    torch.testing.assert_close(out, _reference(cfg, batch, q, k, v, 0.125))


def test_cascade_of_a_verify_chain_keeps_its_causal_own_level(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    tables = [[10, 11, 12, 20, 21], [10, 11, 12, 30, 31], [10, 11, 12, 40]]
    batch = _shared_batch(Phase.VERIFY, [3, 4, 2], [19, 20, 15], tables, 4)
    plan, out, plain_out, (q, k, v) = _run_both(fake_flashinfer, cfg, batch)
    assert plan.cascade is not None and plan.cascade.groups == ((0, 3),)
    assert plan.cascade.shared_pages == (3,)
    p = _FakeWrapper.made[0].plans[0]
    assert p["causal"] is True  # the own level; the shared level is never causal
    assert [t.tolist() for t in p["qo_indptr_arr"]] == [[0, 9], [0, 3, 7, 9]]
    torch.testing.assert_close(out, plain_out)
    torch.testing.assert_close(out, _reference(cfg, batch, q, k, v, 0.125))


@pytest.mark.parametrize(
    ("tables", "kv_lens", "why"),
    [
        ([[1, 2, 3, 4], [5, 6, 7, 8]], [16, 16], "nothing shared"),
        ([[1, 2, 3, 4], [9, 1, 2, 3]], [16, 16], "same pages, not a prefix"),
        ([[1, 2, 3, 4], [1, 6, 7, 8]], [16, 16], "saves under a quarter"),
        ([[1, 2, 3, 4], [1, 2, 3, 4], [9]], [16, 16, 3], "a request with no whole page"),
    ],
)
def test_no_cascade_where_the_batch_does_not_allow_it(
    fake_flashinfer: Any, tables: list[list[int]], kv_lens: list[int], why: str
) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    batch = _shared_batch(Phase.DECODE, [1] * len(kv_lens), kv_lens, tables, 4)
    plan, out, _, (q, k, v) = _run_both(fake_flashinfer, cfg, batch)
    assert plan.cascade is None, why
    assert _FakeWrapper.made[0].kind == "BatchDecodeWithPagedKVCacheWrapper", why
    torch.testing.assert_close(out, _reference(cfg, batch, q, k, v, 0.125))


@pytest.mark.parametrize(
    ("change", "options"),
    [
        ({}, {"cascade": False}),
        ({"window_left": 30}, {}),
        ({"kv_dtype": "float8_e4m3fn"}, {}),
        ({"head_dim": 192, "v_head_dim": 128}, {}),
    ],
)
def test_no_cascade_where_the_config_does_not_allow_it(
    fake_flashinfer: Any, change: dict[str, Any], options: dict[str, Any]
) -> None:
    base: dict[str, Any] = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64)
    cfg = mha(page_size=4, **{**base, **change})
    batch = _shared_batch(Phase.DECODE, [1] * 4, _KV, _TABLES, 4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125, **options)
    backend.handler(Phase.DECODE)
    assert backend.plan(batch).cascade is None
    assert all(w.kind != "MultiLevelCascadeAttentionWrapper" for w in _FakeWrapper.made)


def test_no_cascade_for_a_config_returning_lse(
    fake_flashinfer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MultiLevelCascadeAttentionWrapper.run returns no lse
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    cfg = _with_lse(cfg, fake_flashinfer, monkeypatch)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    assert backend.plan(_shared_batch(Phase.DECODE, [1] * 4, _KV, _TABLES, 4)).cascade is None


def test_cascade_option_is_checked(fake_flashinfer: Any) -> None:
    from attn_dispatch import InvalidSpecError

    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    with pytest.raises(InvalidSpecError, match="cascade"):
        fake_flashinfer.FlashInferBackend(cfg, cascade="yes")


def test_cascade_plan_refuses_return_lse(fake_flashinfer: Any) -> None:
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    batch = _shared_batch(Phase.DECODE, [1] * 4, _KV, _TABLES, 4)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    plan = backend.plan(batch)
    assert plan.cascade is not None
    k, v = _caches(cfg, 53, torch.Generator().manual_seed(1))
    with pytest.raises(InvalidBatchError, match="return_lse"):
        backend.handler(Phase.DECODE)(torch.zeros(4, 4, 64), k, v, plan, 0.125, return_lse=True)


def test_cascade_equals_plain_on_random_page_tables(
    fake_flashinfer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random batches: shared prefixes of several lengths, tables that are a prefix of
    another, the same pages at other positions, requests sharing nothing; decode and verify.
    Wherever the cascade ran, its groups truly share their pages before every query, and
    the output equals the plain plan's and the contract's."""
    from hypothesis import HealthCheck
    from hypothesis import given
    from hypothesis import settings
    from hypothesis import strategies as st

    fb = fake_flashinfer
    monkeypatch.setattr(fb, "CASCADE_MIN_SAVED_FRACTION", 0.0)  # any saving: exercise it
    ran = {"cascade": 0, "plain": 0}

    @st.composite
    def batches(draw: Any) -> tuple[Any, int]:
        ps = draw(st.sampled_from([1, 2, 4]))
        phase = draw(st.sampled_from([Phase.DECODE, Phase.VERIFY]))
        prefixes = [list(range(100 * j, 100 * j + draw(st.integers(1, 5)))) for j in (1, 2)]
        n = draw(st.integers(2, 5))
        q_lens, kv_lens, tables, fresh = [], [], [], 1000
        for _ in range(n):
            table = list(prefixes[draw(st.integers(0, 1))]) if draw(st.booleans()) else []
            if table and draw(st.booleans()):  # the prefix's pages, shifted: not a prefix
                table = [fresh, *table]
                fresh += 1
            # a table may be the prefix alone (its last page then holds the queries)
            own = draw(st.integers(0, 3) if table else st.integers(2, 4))
            table += list(range(fresh, fresh + own))
            fresh += own
            q = 1 if phase is Phase.DECODE else draw(st.integers(1, 3))
            kv = max((len(table) - 1) * ps + draw(st.integers(1, ps)), q)
            if kv > len(table) * ps:
                continue  # too few keys for the queries: not a batch
            q_lens.append(q)
            kv_lens.append(kv)
            tables.append(table)
        if len(kv_lens) < 2:
            q_lens, kv_lens, tables = [1, 1], [ps + 1, ps + 1], [[7, 8], [7, 9]]
            phase = Phase.DECODE
        return _shared_batch(phase, q_lens, kv_lens, tables, ps), ps

    # derandomized: the same examples every run, so the count checked below cannot flake
    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=batches())
    def check(case: tuple[Any, int]) -> None:
        batch, ps = case
        cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=ps)
        plan, out, plain_out, (q, k, v) = _run_both(fb, cfg, batch)
        ran["plain" if plan.cascade is None else "cascade"] += 1
        torch.testing.assert_close(out, plain_out)
        torch.testing.assert_close(out, _reference(cfg, batch, q, k, v, 0.125))
        if plan.cascade is None:
            return
        qo, kv = batch.qo_indptr_host.tolist(), batch.kv_indptr_host.tolist()
        for (first, stop), pages in zip(plan.cascade.groups, plan.cascade.shared_pages,
                                        strict=True):  # fmt: skip
            assert stop - first >= 2 and pages >= 1
            head = batch.kv_indices[kv[first] : kv[first] + pages].tolist()
            for i in range(first, stop):
                assert batch.kv_indices[kv[i] : kv[i] + pages].tolist() == head
                q_len = qo[i + 1] - qo[i]
                assert pages * ps <= int(batch.kv_lens_host[i]) - q_len  # before its queries

    check()
    assert ran["cascade"] > 0 and ran["plain"] > 0, ran


# ---------------------------------------------------------------------------------------
# Real kernels (CUDA only): lse units and the cascade on FlashInfer itself
# ---------------------------------------------------------------------------------------


@needs_flashinfer
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's kernels need CUDA")
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.VERIFY])
def test_real_flashinfer_lse_and_cascade(phase: Phase) -> None:
    """FlashInfer's own kernels: a batch sharing 3 of its pages plans a cascade (validate=True
    puts the page ids on the host), whose output equals the plain plan's and the contract's;
    the plain plan's lse is the natural log (float64 reference)."""
    from attn_dispatch import AttnBatch
    from attn_dispatch.backends.flashinfer.backend import FlashInferBackend

    cfg = mha(num_q_heads=8, num_kv_heads=2, head_dim=128, v_head_dim=128, page_size=16)
    q_lens = [1, 1, 1, 1] if phase is Phase.DECODE else [3, 2, 4, 1]
    tables = [[0, 1, 2, 3 + i, 7 + i] for i in range(4)]
    kv_lens = [70, 75, 66, 80]
    cpu_batch = AttnBatch.build(phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables,
                                page_size=16)  # fmt: skip
    batch = cpu_batch.to("cuda")
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(12, 16, 2, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(12, 16, 2, 128, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), 8, 128, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(128)
    want_out, want_lse = _reference_state(cfg, cpu_batch, q, k, v, scale, dtype=torch.float64)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    cascade = FlashInferBackend(cfg, sm_scale=scale, validate=True)
    plan = cascade.plan(batch)
    assert plan.cascade is not None and plan.cascade.groups == ((0, 4),)
    out = cascade.handler(phase)(qc, kc, vc, plan, scale)
    plain = FlashInferBackend(cfg, sm_scale=scale, cascade=False)
    plain_plan = plain.plan(batch)
    plain_out, lse = plain.handler(phase)(qc, kc, vc, plain_plan, scale, return_lse=True)
    torch.testing.assert_close(out.double().cpu(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(plain_out.double().cpu(), want_out, atol=2e-2, rtol=2e-2)
    assert lse.dtype == torch.float32 and lse.shape == (sum(q_lens), 8)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=2e-2, rtol=1e-3)


# ---------------------------------------------------------------------------------------
# out= (Capabilities.out_buffer): the wrapper's run writes the caller's buffer
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "phase", "q_lens", "kv_lens", "extra", "scales", "route"), _LSE_CASES
)
@pytest.mark.parametrize("lse", [False, True])
def test_out_reaches_the_wrapper_and_is_returned(
    fake_flashinfer: Any,
    kind: str,
    phase: Phase,
    q_lens: list[int],
    kv_lens: list[int],
    extra: dict[str, Any],
    scales: tuple[float, float] | None,
    route: str,
    lse: bool,
) -> None:
    """Every route: the wrapper's run gets out= and the handler returns that buffer, with
    the same numbers as a call without it; a bad buffer is refused before any run."""
    fb = fake_flashinfer
    cfg = _lse_config(kind, extra).replace(return_lse=lse)
    batch = _batch(phase, q_lens, kv_lens, cfg.page_size)
    gen = torch.Generator().manual_seed(23)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    if cfg.kv_dtype != cfg.dtype:
        fp8 = getattr(torch, str(cfg.kv_dtype))
        k_cache = k_cache.to(fp8)
        v_cache = None if v_cache is None else v_cache.to(fp8)
    q = torch.randn(sum(q_lens), cfg.num_q_heads, cfg.head_dim, generator=gen)
    backend = fb.FlashInferBackend(cfg, sm_scale=0.125)
    run = backend.handler(phase)
    plan = backend.plan(batch)
    kw: dict[str, Any] = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    if lse:
        kw["return_lse"] = True
    want = run(q, k_cache, v_cache, plan, 0.125, **kw)
    buf = torch.full((q.shape[0], cfg.num_q_heads, cfg.out_head_dim), math.nan)
    got = run(q, k_cache, v_cache, plan, 0.125, out=buf, **kw)
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == route and wrapper.runs[-1]["out"] is buf
    assert "out" not in wrapper.runs[-2]
    if lse:
        assert got[0] is buf and torch.equal(got[1], want[1])
        want = want[0]
    else:
        assert got is buf
    assert torch.equal(buf, want)
    runs = len(wrapper.runs)
    alias = q.view(-1)[: buf.numel()].view(buf.shape)  # contiguous, in q's bytes
    with pytest.raises(InvalidBatchError, match="shares memory with q") as err:
        run(q, k_cache, v_cache, plan, 0.125, out=alias, **kw)
    assert err.value.field == "out" and len(wrapper.runs) == runs


def test_cascade_copies_into_out(fake_flashinfer: Any) -> None:
    """The cascade wrapper's run takes no out=: its result is copied into the buffer."""
    cfg = mha(num_q_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, page_size=4)
    batch = _shared_batch(Phase.DECODE, [1] * 4, _KV, _TABLES, 4)
    gen = torch.Generator().manual_seed(17)
    k_cache, v_cache = _caches(cfg, int(batch.kv_indices.max()) + 1, gen)
    q = torch.randn(batch.num_tokens, cfg.num_q_heads, cfg.head_dim, generator=gen)
    backend = fake_flashinfer.FlashInferBackend(cfg, sm_scale=0.125)
    run = backend.handler(Phase.DECODE)
    plan = backend.plan(batch)
    assert plan.cascade is not None
    want = run(q, k_cache, v_cache, plan, 0.125)
    buf = torch.full_like(want, math.nan)
    assert run(q, k_cache, v_cache, plan, 0.125, out=buf) is buf
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kind == "MultiLevelCascadeAttentionWrapper"
    assert "out" not in wrapper.runs[-1] and torch.equal(buf, want)
