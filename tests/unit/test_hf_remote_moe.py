"""Imported transformers MoE models (every family) with DynMoE routing, exported as remote-code
directories (format 3): plain transformers, in a process that cannot import dynmoe_dist, loads each with
trust_remote_code=True and computes the trained model's logits (float64 1e-10, float32 1e-6) for both
top-any combine modes, both eval k = 0 rules and the top-k / top-p baselines, with per-layer expert counts
that differ after a removal and an addition; generate() agrees with and without the KV cache; the
directory is refused without trust_remote_code; dynmoe_dist.hf.from_pretrained reads it back.

One subprocess (tests/remote_check.py) for qwen2_moe (gated shared expert), deepseek_v3 (shared experts, a
dense first layer) and gpt_oss (clamped SwiGLU experts, the (hidden, scores) pair), run by default with the
top-k and top-p baselines; one per family for the others (Mixtral, Qwen3-MoE, OLMoE, GLM-4.5...), slow.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_remote_cases import run_remote_check  # noqa: E402
from hf_remote_moe_cases import (  # noqa: E402
    KEEP,
    VOCAB,
    Case,
    export_case,
    family_cases,
    imported_model,
    sample_ids,
)
from hf_tiny import NUM_EXPERTS, randomize, tiny_model  # noqa: E402

from dynmoe_dist.hf import from_pretrained, import_moe  # noqa: E402
from dynmoe_dist.models.hf import remote  # noqa: E402
from dynmoe_dist.models.hf.families import family_of  # noqa: E402
from dynmoe_dist.models.hf.pretrained import dynmoe_section, save_exported  # noqa: E402
from dynmoe_dist.moe.config import MoEConfig  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers  # noqa: E402
from dynmoe_dist.moe.routing import top_any  # noqa: E402

# The three with a block of their own by default; the plain routed blocks and the families whose block one of
# those three has are marked slow, each in a run of its own.
DEFAULT = ("qwen2_moe", "deepseek_v3", "gpt_oss")
SLOW = ("mixtral", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "mistral4", "qwen3_5_moe_text")
FAMILIES = [*DEFAULT, *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}
# Qwen3.5-MoE's linear attention (transformers' chunked gated delta rule) sums long float32 chains whose
# rounding differs between the two processes: 1.8e-6 measured.
FLOAT32_TOL = {"qwen3_5_moe_text": 5e-6}


def tolerance(case):
    return FLOAT32_TOL.get(case.family, TOL[case.dtype]) if case.dtype == torch.float32 else TOL[case.dtype]


# the fine-tuner's save_pretrained round trip, on a family with stock shared modules, in float32: the first run
# stacks the experts' weights for the grouped matmul (the parameters become views into the stack)
RESAVED = Case("qwen2_moe", combine="softmax", dtype=torch.float32)


def run_group(root, families):
    """Export every case of ``families`` and run the subprocess on them: ({name: (dir, case, model)}, result)."""
    exports = {}
    for family in families:
        for name, case in family_cases(family, baselines=family in DEFAULT).items():
            exports[name] = (root / name, case, export_case(root / name, case))
    ids = sample_ids().tolist()
    firsts = [str(root / Case(f).name) for f in families]
    manifest = {
        "cases": [{"dir": str(d), "ids": ids} for d, _, _ in exports.values()],
        "refuse": firsts[0],
        "generate": firsts,
        "prompt_ids": ids[:1],
    }
    if RESAVED.family in families:
        manifest["resave"] = [str(root / RESAVED.name), str(root / "resaved"), ids]
    return exports, run_remote_check(root, manifest)


@pytest.fixture(scope="module")
def default_group(tmp_path_factory):
    return run_group(tmp_path_factory.mktemp("moe_default"), DEFAULT)


@pytest.fixture(scope="module")
def slow_groups(tmp_path_factory):
    """A slow family's own run, made when one of its tests is first selected (``-k glm4_moe`` runs one)."""
    runs = {}

    def run(family):
        if family not in runs:
            runs[family] = run_group(tmp_path_factory.mktemp(f"moe_{family}"), (family,))
        return runs[family]

    return run


@pytest.fixture
def group(request, family):
    """The group run that holds ``family``."""
    return (
        request.getfixturevalue("default_group")
        if family in DEFAULT
        else request.getfixturevalue("slow_groups")(family)
    )


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def of_family(exports, family):
    return {name: entry for name, entry in exports.items() if entry[1].family == family}


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_transformers_computes_the_trained_models_logits(group, family):
    exports, result = group
    assert result["blocked"] and not result["dynmoe_loaded"]
    names, ids = list(exports), sample_ids().tolist()
    for name, (_, case, model) in of_family(exports, family).items():
        got = result["cases"][names.index(name)]
        assert got["keys"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, name
        assert got["class"].startswith("DynMoE") and got["dtype"] == str(case.dtype), name
        want = logits(model, ids)
        assert got["logits"].dtype == case.dtype
        torch.testing.assert_close(got["logits"], want, rtol=0, atol=tolerance(case), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_non_trivial_and_every_option_shows_in_the_logits(group, family):
    """Tokens select 0, 1 and several experts in every MoE layer; the expert counts differ per layer; the
    combine mode and the eval k = 0 rule each change the logits."""
    exports, _ = group
    ids = sample_ids().tolist()
    model = exports[Case(family).name][2]
    seen = []
    for _, layer in find_moe_layers(model):
        layer.routing_observers.append(lambda layer, x_TD, r: seen.append((layer, x_TD)))
    logits(model, ids)
    assert len(seen) == len(family_of(model).sparse_layers())
    for layer, x_TD in seen:
        k_T = top_any(x_TD, layer.router.weight, layer.router.threshold, training=True).num_selected
        assert (k_T == 0).any() and (k_T == 1).any() and (k_T >= 2).any(), k_T.tolist()
    counts = [layer.num_experts for layer, _ in seen]
    assert counts[0] == len(KEEP) and counts[-1] == NUM_EXPERTS + 1, counts
    by_option = {name: logits(entry[2], ids) for name, entry in of_family(exports, family).items()}
    base = by_option[Case(family).name]
    for other in (Case(family, combine="softmax"), Case(family, eval_k0="skip")):
        assert (by_option[other.name] - base).abs().max() > 1e-3, other.name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_uses_the_kv_cache_and_matches_the_trained_model(group, family):
    exports, result = group
    families = list(dict.fromkeys(case.family for _, case, _ in exports.values()))
    got = result["generate"][families.index(family)]
    cached, uncached = got["cache_True"], got["cache_False"]
    prompt = sample_ids().tolist()[:1]
    length = len(prompt[0])
    assert cached["lengths"] == [length] + [1] * 7  # one token per step after the prompt: the cache is used
    assert uncached["lengths"] == list(range(length, length + 8))
    assert cached["tokens"] == uncached["tokens"]
    model = exports[Case(family).name][2]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1)
    assert cached["tokens"] == model.generate(torch.tensor(prompt), use_cache=False, **kwargs).tolist()


def test_without_trust_remote_code_transformers_refuses(default_group):
    _, result = default_group
    for how, error in result["refusals"].items():
        assert error is not None, f"{how}: loaded without trust_remote_code"
        assert "trust_remote_code" in error, f"{how}: {error[:300]}"


def test_save_pretrained_of_the_loaded_model_loads_again(default_group):
    exports, result = default_group
    want = logits(exports[RESAVED.name][2], sample_ids().tolist())
    keys = result["resave"]["keys"]
    assert keys["missing_keys"] == [] and keys["unexpected_keys"] == []
    assert result["resave"]["stacked"], "the round trip did not cover stacked expert weights"
    torch.testing.assert_close(result["resave"]["logits"], want, rtol=0, atol=tolerance(RESAVED))


@pytest.mark.parametrize("family", FAMILIES)
def test_dynmoe_from_pretrained_reads_it_back(group, family):
    exports, _ = group
    ids = sample_ids().tolist()
    for name, (directory, case, model) in of_family(exports, family).items():
        loaded = from_pretrained(directory)
        assert type(loaded) is type(model) and not loaded.training
        want = [(m.num_experts, m.config.router, m.config.combine, m.config.eval_k0) for _, m in find_moe_layers(model)]
        got = [(m.num_experts, m.config.router, m.config.combine, m.config.eval_k0) for _, m in find_moe_layers(loaded)]
        assert got == want, name
        assert next(loaded.parameters()).dtype == case.dtype
        torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=TOL[case.dtype], msg=name)


# -- the section and the config (in process) -----------------------------------------------------------------
def test_the_section_records_what_the_remote_code_needs(tmp_path):
    case = Case("gpt_oss", combine="softmax", eval_k0="skip")
    model = export_case(tmp_path, case)
    config = json.loads((tmp_path / "config.json").read_text())
    section = config["dynmoe"]
    assert section["format"] == 3 and section["step"] == 7
    assert (section["base_model_type"], section["base_architecture"]) == ("gpt_oss", "GptOssForCausalLM")
    assert section["moe_blocks"] == [0, 1, 2] and section["num_experts"] == [4, 6, 7]
    spec = {"expert_kind": "gpt_oss", "activation": "silu", "expert_bias": True, "ffn_dim": 12}
    swiglu = {"swiglu_alpha": model.config.swiglu_alpha, "swiglu_limit": model.config.swiglu_limit}
    assert section["experts"] == [spec | swiglu] * 3
    moe = section["moe"]
    assert (moe["router"], moe["combine"], moe["eval_k0"]) == ("top_any", "softmax", "skip")
    assert [len(t) for t in section["thresholds"]] == [4, 6, 7]
    assert config["model_type"] == "dynmoe_gpt_oss" and config["architectures"] == ["DynMoEGptOssForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dynmoe_moe.DynMoEGptOssConfig",
        "AutoModelForCausalLM": "modeling_dynmoe_moe.DynMoEGptOssForCausalLM",
    }
    assert config["output_router_logits"] is False  # no router logits for transformers' loss to read
    assert all((tmp_path / name).is_file() for name in remote.REMOTE_FILES)


def test_dense_layers_stay_out_of_the_section(tmp_path):
    """Qwen3-MoE's mlp_only_layers and DeepSeek-V3's first_k_dense_replace keep layer 0 dense."""
    for family in ("qwen3_moe", "deepseek_v3"):
        case = Case(family)
        export_case(tmp_path / family, case)
        section = json.loads((tmp_path / family / "config.json").read_text())["dynmoe"]
        assert section["moe_blocks"] == [1, 2] and section["num_experts"] == [4, 7], family
        assert section["experts"][0] == {
            "expert_kind": "gated",
            "activation": "silu",
            "expert_bias": False,
            "ffn_dim": 12,
        }


def test_an_export_that_would_lie_is_refused():
    """The section names the family's sparse layers, the layers' own routing options, and no native router
    (that model goes back to the stock layout)."""
    model = imported_model(Case("qwen3_moe"))
    with pytest.raises(
        ValueError, match=r"blocks \(\[0, 1, 2\]\) != the sparse layers of the qwen3_moe model \(\[1, 2\]\)"
    ):
        dynmoe_section(model, Case("qwen3_moe").moe(), [0, 1, 2])
    with pytest.raises(ValueError, match=r"layers.1.mlp.moe: combine \('equal'\) != the exported MoE options' combine"):
        dynmoe_section(model, MoEConfig(combine="softmax"))
    native = import_moe(randomize(tiny_model("mixtral", VOCAB)))
    with pytest.raises(ValueError, match=r"router 'native' .* no remote-code export; .*stock_layout.save_stock"):
        dynmoe_section(native, MoEConfig(router="native"))


def test_from_pretrained_refuses_moe_blocks_that_are_not_the_sparse_layers(tmp_path):
    export_case(tmp_path, Case("qwen3_moe"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["dynmoe"]["moe_blocks"] = [0, 1]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MoE blocks \(\[0, 1\]\) are not the sparse layers of the qwen3_moe model"):
        from_pretrained(tmp_path)


def bf16_deepseek_with_float32_router():
    """DeepSeek-V3 as transformers loads it in bf16 (gate.weight stays float32, with values bf16 cannot hold),
    imported with top-any."""
    model = randomize(tiny_model("deepseek_v3", VOCAB))
    gates = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")}
    model.to(torch.bfloat16)
    for name, weight in gates.items():
        model.get_submodule(name.removesuffix(".weight")).weight = torch.nn.Parameter(weight)
    return import_moe(model, MoEConfig(router="top_any")).eval()


def test_deepseeks_float32_router_stays_float32_in_a_bf16_export(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = bf16_deepseek_with_float32_router()
    routers = {name: layer.router.weight for name, layer in find_moe_layers(model)}
    assert {w.dtype for w in routers.values()} == {torch.float32}  # what import_moe keeps
    save_exported(model, dynmoe_section(model, MoEConfig(router="top_any")), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(f"{name}.router.weight").dtype for name in routers} == {torch.float32}
    ids = sample_ids().tolist()
    ours = from_pretrained(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert ours.model.embed_tokens.weight.dtype == theirs.model.embed_tokens.weight.dtype == torch.bfloat16
    for loaded in (ours, theirs):
        got = {name: loaded.get_parameter(f"{name}.router.weight") for name in routers}
        assert all(
            torch.equal(got[name], weight) and got[name].dtype == torch.float32 for name, weight in routers.items()
        )
    torch.testing.assert_close(logits(ours, ids), logits(model, ids), rtol=0, atol=0)
    torch.testing.assert_close(logits(theirs, ids), logits(model, ids), rtol=0, atol=0.05)
