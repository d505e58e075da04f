"""Export format 3 of upcycled dense bases: plain transformers loads the directory with trust_remote_code=True
and no dynmoe_dist, and computes what dynmoe_dist's own model computes (LLaMA, Qwen2, Mistral, GPT-2 bases;
float32 and float64; eval_k0 'top1' and 'skip'); it refuses the directory without trust_remote_code;
generation uses the KV cache; dynmoe_dist.hf.from_pretrained reads format 3, and formats 2 and 1 as older
exports wrote them. Imported MoE families: test_hf_remote_moe.py.

One subprocess (tests/remote_check.py, dynmoe_dist blocked by a meta-path finder) does every plain
transformers load; this module compares its results with the training code's models."""

import ast
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_remote_cases import ARCHS, export_case, run_remote_check, sample_ids  # noqa: E402

from dynmoe_dist.hf import from_pretrained  # noqa: E402
from dynmoe_dist.models.hf import remote  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers  # noqa: E402
from dynmoe_dist.moe.routing import top_any  # noqa: E402

DTYPES = {"float32": (torch.float32, 1e-6), "float64": (torch.float64, 1e-9)}
MODES = ("top1", "skip")
PROMPT = "the cat sat on"


def case_name(arch, dtype, mode):
    return f"{arch}_{dtype}_{mode}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{case name: (directory, dynmoe_dist model)} and the subprocess's results."""
    root = tmp_path_factory.mktemp("remote")
    cases = {}
    for arch in ARCHS:
        for dtype_name, (dtype, _) in DTYPES.items():
            for mode in MODES:
                name = case_name(arch, dtype_name, mode)
                cases[name] = (root / name, export_case(root / name, arch, dtype, mode))
    ids = sample_ids(16).tolist()
    f32 = [str(cases[case_name(a, "float32", "top1")][0]) for a in ARCHS]
    manifest = {
        "cases": [{"dir": str(d), "ids": ids} for d, _ in cases.values()],
        "refuse": f32[0],
        "generate": f32,
        "prompt_ids": prompt_ids(f32[0]),
        "pipeline": [[d, PROMPT] for d in f32],
    }
    manifest["resave"] = [str(cases[case_name("qwen2", "float64", "skip")][0]), str(root / "resaved"), ids]
    return cases, run_remote_check(root, manifest), ids


def prompt_ids(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)(
        PROMPT, return_tensors="pt"
    ).input_ids.tolist()


def reference_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_the_subprocess_ran_without_dynmoe_dist(exported):
    _, result, _ = exported
    assert result["blocked"] and not result["dynmoe_loaded"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_plain_transformers_computes_the_training_models_logits(exported, arch, dtype_name, mode):
    cases, result, ids = exported
    names = list(cases)
    name = case_name(arch, dtype_name, mode)
    got = result["cases"][names.index(name)]
    dtype, atol = DTYPES[dtype_name]
    assert got["keys"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert got["class"].startswith("DynMoE") and got["dtype"] == str(dtype)
    want = reference_logits(cases[name][1], ids)
    assert got["logits"].dtype == dtype
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_is_non_trivial_and_eval_k0_matters(exported, arch):
    """Tokens select 0, 1 and several experts, so the k = 0 rule and the combine show in the logits."""
    cases, _, ids = exported
    model = cases[case_name(arch, "float64", "top1")][1]
    seen = []
    for _, layer in find_moe_layers(model):
        layer.routing_observers.append(lambda layer, x_TD, r: seen.append((layer, x_TD)))
    reference_logits(model, ids)
    for layer, x_TD in seen:
        k_T = top_any(x_TD, layer.router.weight, layer.router.threshold, training=True).num_selected
        assert (k_T == 0).any() and (k_T >= 2).any(), k_T.tolist()
    top1, skip = (reference_logits(cases[case_name(arch, "float64", m)][1], ids) for m in MODES)
    assert (top1 - skip).abs().max() > 1e-3


def test_without_trust_remote_code_transformers_refuses(exported):
    _, result, _ = exported
    for how, error in result["refusals"].items():
        assert error is not None, f"{how}: loaded without trust_remote_code"
        assert "trust_remote_code" in error, f"{how}: {error[:300]}"


@pytest.mark.parametrize("index", range(len(ARCHS)), ids=ARCHS)
def test_greedy_generation_uses_the_kv_cache_and_matches_without(exported, index):
    cases, result, _ = exported
    got = result["generate"][index]
    cached, uncached = got["cache_True"], got["cache_False"]
    assert cached["tokens"] == uncached["tokens"]
    prompt = prompt_ids(cases[case_name(ARCHS[index], "float32", "top1")][0])
    length = len(prompt[0])
    # with the cache every step after the prompt feeds one token; without, the whole sequence (min_new_tokens:
    # all 8 steps run whatever the random weights generate)
    assert cached["lengths"] == [length] + [1] * 7
    assert uncached["lengths"] == list(range(length, length + 8))
    model = cases[case_name(ARCHS[index], "float32", "top1")][1]
    want = model.generate(
        torch.tensor(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=1
    )
    assert cached["tokens"] == want.tolist()


@pytest.mark.parametrize("index", range(len(ARCHS)), ids=ARCHS)
def test_pipeline_generates_the_training_models_greedy_text(exported, index):
    from transformers import AutoTokenizer

    cases, result, _ = exported
    directory, model = cases[case_name(ARCHS[index], "float32", "top1")]
    tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    want = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
    assert want.shape[1] == prompt.shape[1] + 6
    got = result["pipeline"][index]
    assert got["ids"] == want[0].tolist()
    # the text: the prompt, then the continuation (whose decoding of spaces is the tokenizer's business)
    continuation = tokenizer.decode(want[0, prompt.shape[1] :], skip_special_tokens=True)
    assert got["text"].startswith(PROMPT) and got["text"].replace(" ", "").endswith(continuation.replace(" ", ""))


@pytest.mark.parametrize("arch", ARCHS)
def test_dynmoe_from_pretrained_reads_format_3(exported, arch):
    cases, _, ids = exported
    for dtype_name, (_, atol) in DTYPES.items():
        directory, model = cases[case_name(arch, dtype_name, "skip")]
        loaded = from_pretrained(directory)
        assert [m.config.eval_k0 for _, m in find_moe_layers(loaded)] == ["skip", "skip"]
        torch.testing.assert_close(reference_logits(loaded, ids), reference_logits(model, ids), rtol=0, atol=atol)


def test_save_pretrained_of_the_loaded_model_loads_again(exported):
    cases, result, ids = exported
    want = reference_logits(cases[case_name("qwen2", "float64", "skip")][1], ids)
    assert result["resave"]["keys"]["missing_keys"] == [] and result["resave"]["keys"]["unexpected_keys"] == []
    torch.testing.assert_close(result["resave"]["logits"], want, rtol=0, atol=1e-9)


def as_format_1(directory, out):
    """What the format-1 export wrote: the base model's config.json + the section, no remote code."""
    out.mkdir()
    config = json.loads((directory / "config.json").read_text())
    section = config.pop("dynmoe")
    for key in ("auto_map", "transformers_version"):
        config.pop(key)
    config.update(model_type=section["base_model_type"], architectures=[section["base_architecture"]])
    section["format"] = 1
    (out / "config.json").write_text(json.dumps({**config, "dynmoe": section}))
    (out / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    return out


def as_format_2(directory, out):
    """What the format-2 export wrote for a dense base: the same directory, its section without moe.combine."""
    shutil.copytree(directory, out)
    config = json.loads((out / "config.json").read_text())
    config["dynmoe"]["format"] = 2
    del config["dynmoe"]["moe"]["combine"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_dynmoe_from_pretrained_still_reads_format_2(exported, tmp_path):
    cases, _, ids = exported
    directory, model = cases[case_name("mistral", "float64", "skip")]
    loaded = from_pretrained(as_format_2(directory, tmp_path / "v2"))
    assert [m.config.combine for _, m in find_moe_layers(loaded)] == ["equal", "equal"]
    torch.testing.assert_close(reference_logits(loaded, ids), reference_logits(model, ids), rtol=0, atol=1e-9)


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_dynmoe_from_pretrained_still_reads_format_1(exported, arch, tmp_path):
    cases, _, ids = exported
    directory, model = cases[case_name(arch, "float64", "top1")]
    loaded = from_pretrained(as_format_1(directory, tmp_path / "v1"))
    torch.testing.assert_close(reference_logits(loaded, ids), reference_logits(model, ids), rtol=0, atol=1e-9)


def test_remote_files_import_only_torch_and_transformers():
    allowed = {"typing", "importlib", "torch", "transformers"}
    for name in remote.REMOTE_FILES:
        tree = ast.parse((Path(remote.__file__).parent / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"
