"""Imported transformers MoE families (models/hf/families/, moe_import.py, stock_layout.py,
safetensors_reader.py) on tiny random models of all six families (tests/hf_tiny.py MOE_FAMILIES).

The converted model must compute what transformers computes on the same weights and tokens: logits, the
loss with the family's load-balance loss (output_router_logits on), and every gradient, mapped back to the
fused checkpoint tensors through the key mapping: 1e-10 in float64 (transformers' eager experts: its
grouped-mm path refuses float64), 1e-5 in float32 (its default grouped-mm experts). Written back in the
stock layout, plain transformers loads it and computes the same logits, also with experts removed.
"""

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, MOE_FFN, NUM_EXPERTS, randomize, tiny_model  # noqa: E402

from dynmoe_dist.models.hf.families import causal_lm_class, family_of, sparse_block_prefixes  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.models.hf.safetensors_reader import CheckpointReader, read_all  # noqa: E402
from dynmoe_dist.models.hf.stock_layout import imported_blocks, save_stock, stock_state_dict  # noqa: E402
from dynmoe_dist.models.hf.upcycle import MoEBlock  # noqa: E402
from dynmoe_dist.moe import MoEConfig  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.moe.layer import NativeRouter, TopAnyRouter  # noqa: E402

FAMILIES = list(MOE_FAMILIES)
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference(family, dtype=torch.float64, seed=0, **overrides):
    """The family's tiny model with every weight random, in training mode; eager experts for float64."""
    impl = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = tiny_model(family, **{**AUX, **impl, **overrides}).to(dtype)
    return randomize(model, seed=seed).train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the load-balance loss must drop these rows as transformers does
    return ids, mask


def their_loss(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    return out.logits, out.loss


def our_loss(model, ids, mask):
    with collect_aux_losses() as aux:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
    # transformers adds coef * aux to its (float32) cross-entropy: the same sum, in the same dtype
    return out.logits, out.loss + aux.total(out.logits, mask).to(out.loss.dtype)


def close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol * max(1.0, b.double().abs().max().item()), f"{what}: max error {err}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_loss_and_every_gradient_equal_transformers(family, dtype):
    ref = reference(family, dtype)
    ours = import_moe(copy.deepcopy(ref))
    assert len(imported_blocks(ours)) == len(family_of(ref).sparse_layers())
    ids, mask = batch()
    logits_t, loss_t = their_loss(ref, ids, mask)
    logits_o, loss_o = our_loss(ours, ids, mask)
    tol = TOL[dtype]
    close(logits_o, logits_t, tol, "logits")
    close(loss_o, loss_t, tol, "loss")
    loss_t.backward()
    loss_o.backward()
    # an expert no token chose has no gradient here, and zeros in its slice of the fused gradient there
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in ours.named_parameters()}
    mapped = family_of(ref).to_fused_layout(grads, sparse_block_prefixes(ref))
    want = {name: p.grad for name, p in ref.named_parameters()}
    assert set(mapped) == set(want)
    for name, grad in want.items():
        close(mapped[name], grad, tol, name)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_load_balance_loss_is_in_the_compared_loss(family):
    # The same model without output_router_logits: the loss drops by coef * aux, which the collection added.
    ids, mask = batch()
    with_aux = our_loss(import_moe(reference(family)), ids, mask)[1]
    without = our_loss(import_moe(reference(family, output_router_logits=False)), ids, mask)[1]
    assert with_aux.item() - without.item() > 0.05  # 0.1 * aux, aux >= k = 2 at best balance... ~ 0.2


@pytest.mark.parametrize("family", FAMILIES)
def test_key_mapping_both_ways_is_transformers_state_and_checkpoint_exactly(family, tmp_path):
    ref = reference(family)
    ours = import_moe(copy.deepcopy(ref))
    adapter, prefixes, state = family_of(ref), sparse_block_prefixes(ref), ours.state_dict()
    # in memory: transformers' fused parameters, and back
    fused, theirs = adapter.to_fused_layout(state, prefixes), ref.state_dict()
    assert set(fused) == set(theirs) and all(torch.equal(fused[k], theirs[k]) for k in theirs)
    back = adapter.from_fused_layout(theirs, prefixes)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    # on disk: exactly the tensors transformers' own save_pretrained writes
    ref.save_pretrained(tmp_path)
    files, ours_on_disk = read_all(tmp_path), adapter.to_checkpoint_layout(state, prefixes)
    assert set(ours_on_disk) == set(files) and all(torch.equal(ours_on_disk[k], files[k]) for k in files)


def test_dense_layers_stay_dense_and_shared_experts_stay_the_checkpoints_modules():
    qwen3 = import_moe(reference("qwen3_moe"))
    assert type(qwen3.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"  # mlp_only_layers = [0]
    assert [isinstance(layer.mlp, MoEBlock) for layer in qwen3.model.layers] == [False, True, True]
    deepseek = import_moe(reference("deepseek_v3"))
    assert type(deepseek.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace = 1
    assert type(deepseek.model.layers[1].mlp.shared_experts).__name__ == "DeepseekV3MLP"
    qwen2 = import_moe(reference("qwen2_moe"))
    assert type(qwen2.model.layers[1].mlp.shared_expert).__name__ == "Qwen2MoeMLP"
    block = qwen2.model.layers[1].mlp
    assert block.moe.experts.config.expert_kind == "gated" and isinstance(block.moe.router, NativeRouter)
    assert qwen2.config.output_router_logits is False  # the loss comes from the aux collection now


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_generate_gives_transformers_tokens(family):
    ref = reference(family).eval()
    ours = import_moe(copy.deepcopy(ref))
    ids = batch()[0][:1, :4]
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


# -- the stock layout written back -------------------------------------------------------------------
def load_stock(directory):
    """Plain transformers' load (AutoModelForCausalLM; Mistral 4, which its mapping leaves out, by its class)."""
    from transformers import AutoConfig

    cls = causal_lm_class(AutoConfig.from_pretrained(directory))
    return cls.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_loads_in_plain_transformers_with_the_same_logits(family, tmp_path):
    ref = reference(family).eval()
    ours = import_moe(copy.deepcopy(ref))
    loaded = load_stock(save_stock(ours, tmp_path / "stock")).eval()
    assert type(loaded) is type(ref) and loaded.config.output_router_logits is True
    ids = batch()[0]
    close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, 1e-10, "logits")


KEEP = [0, 2, 3, 5]  # 4 of 6: DeepSeek's 2 groups keep 2 experts each


@pytest.mark.parametrize("family", FAMILIES)
def test_with_experts_removed_the_written_checkpoint_has_fewer_and_matches_ours(family, tmp_path):
    ours = import_moe(reference(family)).eval()
    for _, block in imported_blocks(ours):
        block.moe.experts.keep(KEEP)
        block.moe.router.resize(KEEP, torch.zeros(0, block.moe.config.dim))
    loaded = load_stock(save_stock(ours, tmp_path / "stock")).eval()
    assert family_of(loaded).num_experts() == len(KEEP)
    config = json.loads((tmp_path / "stock" / "config.json").read_text())
    assert config[family_of(loaded).num_experts_key] == len(KEEP)
    ids = batch()[0]
    close(loaded(input_ids=ids).logits, ours(input_ids=ids).logits, 1e-10, "logits")


def test_only_native_routers_and_one_expert_count_are_written_back():
    top_any = import_moe(reference("mixtral"), MoEConfig(router="top_any"))
    with pytest.raises(ValueError, match=r"router 'top_any' has no stock transformers equivalent"):
        stock_state_dict(top_any)
    uneven = import_moe(reference("mixtral"))
    imported_blocks(uneven)[0][1].moe.experts.keep([0, 1, 2])
    imported_blocks(uneven)[0][1].moe.router.resize([0, 1, 2], torch.zeros(0, 16))
    with pytest.raises(ValueError, match=r"one expert count per model; the MoE blocks have \[3, 6, 6\]"):
        stock_state_dict(uneven)


# -- reading slices ---------------------------------------------------------------------------------
class Spy:
    """Wraps safe_open: records every whole-tensor read and every slice read (key, index)."""

    def __init__(self, monkeypatch):
        self.tensors, self.slices = [], []
        real = safetensors.safe_open
        spy = self

        class Handle:
            def __init__(self, *args, **kwargs):
                self.inner = real(*args, **kwargs)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, key):
                spy.tensors.append(key)
                return self.inner.get_tensor(key)

            def get_slice(self, key):
                inner = self.inner.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return inner.get_shape()

                    def __getitem__(self, index):
                        spy.slices.append((key, index))
                        return inner[index]

                return Slice()

        monkeypatch.setattr(safetensors, "safe_open", Handle)


@pytest.mark.parametrize(
    "family, how",
    [("qwen2_moe", "save_pretrained"), ("mixtral", "save_pretrained"), ("gpt_oss", "save_pretrained")]
    + [("deepseek_v3", "state_dict")]
    + [(family, "save_pretrained") for family in ("glm4_moe", "minimax_m2", "mistral4", "qwen3_5_moe_text")],
)
def test_reader_reads_one_expert_and_nothing_of_the_others(family, how, tmp_path, monkeypatch):
    # save_pretrained writes one key per expert (gpt-oss: fused tensors), sharded here; a state_dict saved as
    # it is keeps transformers' fused tensors. Either way only expert 4's bytes are read.
    from safetensors.torch import save_file

    ref = reference(family)
    if how == "save_pretrained":
        ref.save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        save_file(ref.state_dict(), str(tmp_path / "model.safetensors"))
    adapter, prefix = family_of(ref), sparse_block_prefixes(ref)[-1]
    spy = Spy(monkeypatch)
    with CheckpointReader(tmp_path) as reader:
        got = adapter.read_expert(reader, prefix, 4)
        router = adapter.read_router(reader, prefix)
    want = adapter.expert_tensors({k: ref.get_parameter(f"{prefix}.{k}") for k in adapter.fused_keys()}, 4)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert all(got[n].is_contiguous() for n in got)
    theirs_router = dict(ref.named_parameters()) | dict(ref.named_buffers())
    assert all(torch.equal(router[n], theirs_router[f"{prefix}.{k}"]) for n, k in adapter.router_keys().items())
    expert_tensors_read = [k for k in spy.tensors if ".experts." in k]
    slices_read = [(k, index) for k, index in spy.slices if isinstance(index, tuple)]
    if adapter.checkpoint_experts is not None and how == "save_pretrained":  # one key per expert: expert 4's
        assert sorted(expert_tensors_read) == sorted(adapter.checkpoint_expert_keys(prefix, 4).values())
        assert not slices_read
    else:  # fused tensors: slices inside expert 4 only, never a whole fused tensor
        assert not expert_tensors_read and slices_read and all(index[0] == 4 for _, index in slices_read)
        if family == "deepseek_v3":  # gate rows 0:F and up rows F:2F of gate_up_proj[4]
            halves = [index[1] for k, index in slices_read if k.endswith("gate_up_proj")]
            assert halves == [slice(0, MOE_FFN), slice(MOE_FFN, 2 * MOE_FFN)]


def test_an_index_naming_a_missing_shard_is_one_line_naming_the_file(tmp_path):
    reference("mixtral").save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(ValueError) as err:
        CheckpointReader(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(index) in message and shard in message and "does not exist" in message


@pytest.mark.parametrize(
    "family, key, cut, want",
    [
        ("olmoe", "model.layers.1.mlp.experts.3.up_proj.weight", (slice(0, -2),), (MOE_FFN, 16)),
        ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj", (slice(None), slice(None), slice(0, -2)), None),
    ],
)
def test_a_stored_expert_tensor_of_the_wrong_shape_is_one_line_naming_file_key_and_shapes(
    family, key, cut, want, tmp_path
):
    from safetensors.torch import save_file

    ref = reference(family)
    ref.save_pretrained(tmp_path)
    state = read_all(tmp_path)
    good = tuple(state[key].shape)
    state[key] = state[key][cut].contiguous()  # a checkpoint that disagrees with its config
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with CheckpointReader(tmp_path) as reader, pytest.raises(ValueError) as err:
        family_of(ref).check_block_shapes(reader, "model.layers.1.mlp")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "model.safetensors") in message and key in message
    assert str(tuple(state[key].shape)) in message and str(want or good) in message


# -- conversion to DynMoE top-any, and detection ----------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_top_any_gate_vectors_start_as_the_router_rows_thresholds_at_zero(family):
    ref = reference(family)
    ours = import_moe(copy.deepcopy(ref), MoEConfig(router="top_any"))
    for prefix, block in imported_blocks(ours):
        router = block.moe.router
        assert isinstance(router, TopAnyRouter)
        key = next(iter(family_of(ref).router_keys().values()))
        assert torch.equal(router.weight, ref.get_parameter(f"{prefix}.{key}"))
        assert torch.equal(router.threshold, torch.zeros(NUM_EXPERTS, dtype=torch.float64))
    with collect_aux_losses() as aux:
        ours(input_ids=batch()[0])
    assert len(aux.losses) == len(imported_blocks(ours)) and not aux.balance  # DynMoE's losses, not the family's


def test_the_threshold_hook_sets_each_blocks_thresholds():
    seen = []

    def calibrate(prefix, layer):
        seen.append(prefix)
        return torch.full((layer.num_experts,), 0.25)

    ours = import_moe(reference("mixtral"), MoEConfig(router="top_any"), thresholds=calibrate)
    assert seen == sparse_block_prefixes(ours)
    assert all(torch.equal(b.moe.router.threshold, torch.full((6,), 0.25).double()) for _, b in imported_blocks(ours))
    with pytest.raises(ValueError, match=r"a threshold hook needs router 'top_any', router is 'native'"):
        import_moe(reference("mixtral"), thresholds=calibrate)
    with pytest.raises(ValueError, match=r"thresholds for model.layers.0.mlp: shape \(5,\) != \(6,\)"):
        import_moe(reference("mixtral"), MoEConfig(router="top_any"), thresholds=lambda p, layer: torch.zeros(5))


def test_unsupported_model_type_is_one_line_listing_the_supported():
    with pytest.raises(ValueError) as err:
        family_of(tiny_model("llama"))
    message = str(err.value)
    assert "\n" not in message and "'llama'" in message
    assert all(f in message for f in FAMILIES)


def test_mixtral_router_jitter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"router_jitter_noise \(0.1\) > 0 is not supported"):
        import_moe(tiny_model("mixtral", router_jitter_noise=0.1))


# -- inside the trainer's wrapper ---------------------------------------------------------------------
def test_the_training_wrapper_returns_the_family_loss_with_padding_dropped():
    from dynmoe_dist.hf import HFCausalLM

    ref = reference("qwen3_moe")
    ids, mask = batch()
    theirs = ref(input_ids=ids, attention_mask=mask)
    out = HFCausalLM(import_moe(copy.deepcopy(ref)))(ids, mask)
    assert torch.equal(out.aux_loss, (0.1 * theirs.aux_loss).to(out.aux_loss.dtype))
    close(out.logits, theirs.logits, 1e-10, "logits")


def test_activation_checkpointing_reports_each_layer_once_and_keeps_the_gradients():
    ids, mask = batch()
    plain = import_moe(reference("gpt_oss"))
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable()
    results = []
    for model in (plain, checkpointed):
        with collect_aux_losses() as aux:
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            loss = out.loss + aux.total(out.logits, mask).to(out.loss.dtype)
        loss.backward()  # the recomputation runs here, outside the collection
        results.append((len(aux.balance), loss, {n: p.grad for n, p in model.named_parameters()}))
    (count, loss, grads), (count_c, loss_c, grads_c) = results
    assert count == count_c == 3
    close(loss_c, loss, 1e-12, "loss")
    for name, grad in grads.items():
        assert (grad is None) == (grads_c[name] is None), name
        if grad is not None:
            close(grads_c[name], grad, 1e-10, name)


def test_a_bare_decoder_imports_under_its_own_keys():
    ref = reference("olmoe")
    assert sparse_block_prefixes(ref) == [f"model.layers.{i}.mlp" for i in range(3)]
    bare = import_moe(copy.deepcopy(ref.model))  # OlmoeModel: keys start at layers.
    assert sparse_block_prefixes(bare) == [f"layers.{i}.mlp" for i in range(3)]
    assert [prefix for prefix, _ in imported_blocks(bare)] == sparse_block_prefixes(bare)
    ids = batch()[0]
    close(bare(input_ids=ids).last_hidden_state, ref.model(input_ids=ids).last_hidden_state, 1e-10, "hidden")


def test_a_sparse_layer_without_the_fused_experts_is_refused_by_name():
    model = reference("mixtral")
    model.model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(
        ValueError, match=r"model.layers.1.mlp: expected the mixtral sparse MoE block .* found Identity"
    ):
        import_moe(model)


def test_reader_mistakes_are_one_line_naming_the_directory_or_file(tmp_path):
    with pytest.raises(ValueError, match=r"neither model.safetensors nor model.safetensors.index.json"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no safetensors index with a weight_map"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    reference("mixtral").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"the checkpoint holds no tensor 'model.layers.0.mlp.gate.weight'"):
        CheckpointReader(tmp_path).tensor("model.layers.0.mlp.gate.weight")  # Mixtral's is block_sparse_moe


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_model_built_on_the_meta_device_imports_to_the_same_keys_and_shapes(family):
    # What an expert-parallel job builds before it reads its own slices (expert_sources / read_expert).
    import transformers
    from hf_tiny import FAMILIES, tiny_config

    with torch.device("meta"):
        meta = getattr(transformers, FAMILIES[family][1])(tiny_config(family))
    import_moe(meta)
    real = import_moe(tiny_model(family)).state_dict()
    state = meta.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in real.items()}
    assert all(v.is_meta for v in state.values())
