"""Run by tests/unit/test_hf_remote.py in a subprocess that cannot import dynmoe_dist: plain transformers
loads the exported directories listed in MANIFEST (a JSON file) and writes what it computed to OUT (.pt).

    python tests/remote_check.py MANIFEST OUT

MANIFEST: {"cases": [{"dir", "ids"}], and optionally "refuse": dir, "generate": [dir], "prompt_ids",
"pipeline": [[dir, prompt]], "resave": [dir, new dir, ids]}. The parent compares everything against
dynmoe_dist's own models; this script only computes.
"""

import importlib.abc
import json
import sys


class BlockDynMoE(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: dynmoe_dist (which the editable install would otherwise find) cannot load."""

    def find_spec(self, name, path=None, target=None):
        if name == "dynmoe_dist" or name.startswith("dynmoe_dist."):
            raise ImportError(f"{name} is blocked in this process")
        return None


sys.meta_path.insert(0, BlockDynMoE())


def blocked() -> bool:
    try:
        import dynmoe_dist  # noqa: F401
    except ImportError:
        return True
    return False


def load(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, output_loading_info=True, **kwargs
    )
    keys = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.eval(), keys


def logits_of(case):
    import torch

    model, keys = load(case["dir"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(case["ids"])).logits
    return {"logits": logits, "keys": keys, "class": type(model).__name__, "dtype": str(model.dtype)}


def refusals(directory):
    """The error each no-trust load raises (None if it loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for name, call in (
        ("model_default", lambda: AutoModelForCausalLM.from_pretrained(directory)),
        ("model_false", lambda: AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=False)),
        ("config_false", lambda: AutoConfig.from_pretrained(directory, trust_remote_code=False)),
    ):
        try:
            call()
            out[name] = None
        except Exception as err:  # whatever transformers raises: the parent checks it is a refusal
            out[name] = f"{type(err).__name__}: {err}"
    return out


def generations(directory, prompt_ids):
    """Greedy tokens with and without the KV cache, and the sequence lengths the decoder saw per step."""
    import torch

    model, _ = load(directory)
    decoder = getattr(model, "model", None) or model.transformer
    seen = []

    def record(module, args, kwargs):
        given = kwargs.get("input_ids")
        given = given if given is not None else kwargs.get("inputs_embeds")
        seen.append((given if given is not None else args[0]).shape[1])

    decoder.register_forward_pre_hook(record, with_kwargs=True)
    out = {}
    for use_cache in (True, False):
        seen.clear()
        ids = model.generate(
            torch.tensor(prompt_ids),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=1,
        )
        out[f"cache_{use_cache}"] = {"tokens": ids.tolist(), "lengths": list(seen)}
    return out


def pipelined(directory, prompt):
    from transformers import pipeline

    generate = pipeline("text-generation", model=directory, trust_remote_code=True)
    text = generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)[0]["generated_text"]
    ids = generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1, return_tensors=True)
    return {"text": text, "ids": list(ids[0]["generated_token_ids"])}


def resaved(directory, new_directory, ids):
    """A fine-tuner's round trip: the loaded model run once (which may stack its experts' weights for the
    grouped matmul), its save_pretrained (transformers copies the remote code along), then the logits of
    that directory loaded again; "stacked": whether the first run stacked them."""
    import torch

    model, _ = load(directory)
    with torch.no_grad():
        model(input_ids=torch.tensor(ids))
    stacked = any(bool(getattr(m, "_stacked", None)) for m in model.modules())
    model.save_pretrained(new_directory)
    return {**logits_of({"dir": new_directory, "ids": ids}), "stacked": stacked}


def main(manifest_file, out_file):
    import torch

    manifest = json.loads(open(manifest_file).read())
    result = {"blocked": blocked(), "cases": [logits_of(case) for case in manifest["cases"]]}
    if "refuse" in manifest:
        result["refusals"] = refusals(manifest["refuse"])
    result["generate"] = [generations(d, manifest["prompt_ids"]) for d in manifest.get("generate", [])]
    result["pipeline"] = [pipelined(d, prompt) for d, prompt in manifest.get("pipeline", [])]
    if "resave" in manifest:
        result["resave"] = resaved(*manifest["resave"])
    result["dynmoe_loaded"] = any(m.startswith("dynmoe_dist") for m in sys.modules)
    torch.save(result, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
