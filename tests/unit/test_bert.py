"""The plain-torch BERT: strict weight loading, sentence embeddings, and upcycling its FFNs."""

import pytest
import torch
import torch.nn.functional as F

from dynmoe_dist import MoEConfig, MoELayer, upcycle
from dynmoe_dist.models.bert import (
    BertClassifier,
    BertConfig,
    BertTokenizer,
    convert_hf_state_dict,
    load_bert,
    mean_pool,
    minilm_dir,
)

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",  # paraphrase of 0
    "The stock market fell sharply today.",  # unrelated to 0 and 1
    "It's a charming and often affecting journey.",
]


@pytest.fixture(scope="module")
def bert():
    return load_bert().eval()


@pytest.fixture(scope="module")
def hf_state():
    from safetensors.torch import load_file

    return load_file(str(minilm_dir() / "model.safetensors"))


def embeddings(model, texts, max_len=32):
    batch = BertTokenizer(max_len)(texts)
    with torch.no_grad():
        h_BLD, _ = model(**batch)
    return F.normalize(mean_pool(h_BLD, batch["valid_BL"]), dim=-1)


def test_config_is_read_from_config_json():
    cfg = BertConfig.from_json(minilm_dir() / "config.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (
        384,
        6,
        12,
        1536,
    )
    assert cfg.layer_norm_eps == 1e-12 and cfg.hidden_act == "gelu"


def test_weights_land_in_the_right_modules(bert, hf_state):
    assert len(bert.layers) == 6
    # The FFN is a FeedForward holding HF's intermediate/output dense weights, layer for layer.
    assert torch.equal(bert.layers[2].ffn.w_in, hf_state["encoder.layer.2.intermediate.dense.weight"])
    assert torch.equal(bert.layers[2].ffn.b_out, hf_state["encoder.layer.2.output.dense.bias"])
    assert torch.equal(bert.layers[5].attn.key.weight, hf_state["encoder.layer.5.attention.self.key.weight"])
    assert torch.equal(bert.layers[0].norm_ffn.weight, hf_state["encoder.layer.0.output.LayerNorm.weight"])
    assert torch.equal(bert.embeddings.word.weight, hf_state["embeddings.word_embeddings.weight"])


def test_key_mapping_is_strict(hf_state):
    cfg = BertConfig()
    missing = {k: v for k, v in hf_state.items() if k != "encoder.layer.3.attention.self.value.bias"}
    with pytest.raises(ValueError, match=r"missing \['encoder.layer.3.attention.self.value.bias'\]"):
        convert_hf_state_dict(missing, cfg, num_layers=6)
    extra = {**hf_state, "encoder.layer.0.adapter.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected \['encoder.layer.0.adapter.weight'\]"):
        convert_hf_state_dict(extra, cfg, num_layers=6)
    # Keeping 2 layers: the other 4 layers' keys are expected, not "unexpected".
    assert len(convert_hf_state_dict(hf_state, cfg, num_layers=2)) == 5 + 2 * 16


def test_keep_first_layers():
    assert len(load_bert(num_layers=2).layers) == 2
    with pytest.raises(ValueError, match=r"num_layers \(7\)"):
        load_bert(num_layers=7)


def test_tokenizer_truncates_and_pads():
    batch = BertTokenizer(8)(["hello", "one two three four five six seven eight nine"])
    tokens, valid = batch["tokens_BL"], batch["valid_BL"]
    assert tokens.shape == (2, 8) and tokens.dtype == torch.long and valid.dtype == torch.bool
    assert tokens[0, :3].tolist() == [101, 7592, 102]  # [CLS] hello [SEP]
    assert valid[0].tolist() == [True] * 3 + [False] * 5 and tokens[0, 3:].tolist() == [0] * 5
    assert valid[1].all() and tokens[1, 0] == 101 and tokens[1, -1] == 102  # truncated, [SEP] kept


def test_paraphrase_is_closer_than_unrelated(bert):
    e_ND = embeddings(bert, SENTENCES)
    sim = e_ND @ e_ND.t()
    assert sim[0, 1] > 0.5 and sim[0, 2] < 0.2 and sim[1, 2] < 0.2


def test_padding_does_not_change_embeddings(bert):
    short = embeddings(bert, SENTENCES[:1], max_len=16)
    long = embeddings(bert, SENTENCES[:1], max_len=48)
    assert torch.allclose(short, long, atol=1e-5)


def test_upcycled_identical_experts_match_dense_at_eval(bert):
    dense = BertClassifier(load_bert(num_layers=2), num_classes=2).eval()
    moe = BertClassifier(load_bert(num_layers=2), num_classes=2).eval()
    moe.head.load_state_dict(dense.head.state_dict())
    upcycle(moe, MoEConfig(num_experts=4), layers=[0, 1])
    assert isinstance(moe.layers[0].ffn, MoELayer) and len(moe.layers[1].ffn.experts) == 4
    batch = BertTokenizer(24)(SENTENCES)
    with torch.no_grad():
        # Eval: every token uses >= 1 expert (top-1 fallback) and equal copies average to the dense block.
        assert torch.allclose(moe(**batch).logits, dense(**batch).logits, atol=1e-5)


def test_upcycled_layer_matches_dense_on_routed_tokens_in_training(bert):
    torch.manual_seed(0)
    dense_ffn = load_bert(num_layers=1).layers[0].ffn
    model = BertClassifier(load_bert(num_layers=1), num_classes=2).train()
    upcycle(model, MoEConfig(num_experts=4), layers=[0])
    x_TD = torch.randn(64, 384)
    out = model.layers[0].ffn(x_TD)
    routed_T = out.routing.num_selected > 0
    # 4 orthogonal gates at threshold 0: a token misses all of them with chance 1/16; both kinds occur.
    assert 0 < int(routed_T.sum()) < 64
    with torch.no_grad():
        assert torch.allclose(out.output[routed_T], dense_ffn(x_TD)[routed_T], atol=1e-5)
    assert torch.all(out.output[~routed_T] == 0)  # train-time k = 0: the token rides the residual


def test_upcycled_classifier_trains(bert):
    model = BertClassifier(load_bert(num_layers=2), num_classes=3).train()
    upcycle(model, MoEConfig(num_experts=2), layers=[1])
    batch = BertTokenizer(16)(SENTENCES)
    out = model(**batch)
    assert out.logits.shape == (4, 3) and out.aux_loss.item() > 0
    (F.cross_entropy(out.logits, torch.tensor([0, 1, 2, 0])) + out.aux_loss).backward()
    assert model.layers[1].ffn.router.weight.grad is not None
    assert model.layers[1].ffn.experts.experts[0].w_in.grad.abs().sum() > 0
    assert model.layers[0].ffn.w_in.grad.abs().sum() > 0 and model.head.weight.grad is not None


def test_classifier_rejects_one_class():
    with pytest.raises(ValueError, match=r"num_classes \(1\)"):
        BertClassifier(load_bert(num_layers=1), num_classes=1)


@pytest.mark.slow
def test_matches_sentence_transformers(bert):
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = SENTENCES + ["unflinchingly bleak and desperate", "x"]
    expected = torch.tensor(reference.encode(texts, normalize_embeddings=True))
    ours = embeddings(bert, texts, max_len=64)
    assert (ours - expected).abs().max().item() < 1e-4


# -- the same model on transformers.BertModel (model.bert_impl = 'transformers') ----------------------


def test_freeze_names_map_the_builtin_prefixes():
    from dynmoe_dist.models.hf.minilm import freeze_names

    assert freeze_names(["embeddings", "layers.0", "layers.1.attn", "head", "bert.pooler"]) == [
        "bert.embeddings",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1.attn",
        "head",
        "bert.pooler",
    ]


def test_transformers_bert_computes_the_builtin_embeddings(bert):
    from dynmoe_dist.models.hf.minilm import HFSentenceClassifier, load_minilm

    ours = BertClassifier(bert, num_classes=2).eval()
    hf = HFSentenceClassifier(load_minilm(), num_classes=2).eval()
    hf.head.load_state_dict(ours.head.state_dict())
    assert hf.bert.pooler is None and len(hf.bert.encoder.layer) == 6
    batch = BertTokenizer(24)(SENTENCES + ["x"])  # padding on most rows
    with torch.no_grad():
        torch.testing.assert_close(hf(**batch).logits, ours(**batch).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf.embed(**batch)[0], ours.embed(**batch)[0], rtol=0, atol=1e-5)


def test_transformers_bert_upcycled_matches_dense_at_eval():
    from dynmoe_dist.hf import upcycle_hf
    from dynmoe_dist.models.hf.minilm import HFSentenceClassifier, load_minilm

    dense = HFSentenceClassifier(load_minilm(num_layers=2), num_classes=2).eval()
    moe = HFSentenceClassifier(load_minilm(num_layers=2), num_classes=2).eval()
    moe.head.load_state_dict(dense.head.state_dict())
    upcycle_hf(moe.bert, MoEConfig(num_experts=4), layers=[0, 1])
    batch = BertTokenizer(24)(SENTENCES)
    with torch.no_grad():
        assert torch.allclose(moe(**batch).logits, dense(**batch).logits, atol=1e-5)
    with pytest.raises(ValueError, match=r"num_layers \(7\) must be in \[1, 6\]"):
        load_minilm(num_layers=7)


@pytest.mark.slow
def test_transformers_bert_matches_sentence_transformers():
    from dynmoe_dist.models.hf.minilm import HFSentenceClassifier, load_minilm

    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = SENTENCES + ["unflinchingly bleak and desperate", "x"]
    expected = torch.tensor(reference.encode(texts, normalize_embeddings=True))
    model = HFSentenceClassifier(load_minilm(), num_classes=2).eval()
    batch = BertTokenizer(64)(texts)
    with torch.no_grad():
        ours = F.normalize(model.embed(**batch)[0], dim=-1)
    assert (ours - expected).abs().max().item() < 1e-4
