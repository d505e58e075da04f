"""all-MiniLM-L6-v2 on transformers.BertModel (models/hf/minilm.py; its tokenizer: tasks/text.py): weights,
sentence embeddings, and upcycling its MLPs (the model of the minilm-sentiment and jsonl tasks)."""

import pytest
import torch
import torch.nn.functional as F

from dynmoe_dist import MoEConfig
from dynmoe_dist.hf import upcycle_hf
from dynmoe_dist.models.hf.minilm import HFSentenceClassifier, ffn_shape, freeze_names, load_minilm
from dynmoe_dist.models.hf.upcycle import MoEBlock
from dynmoe_dist.tasks.assets import minilm_dir, minilm_num_layers
from dynmoe_dist.tasks.text import MiniLMTokenizer

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",  # paraphrase of 0
    "The stock market fell sharply today.",  # unrelated to 0 and 1
    "It's a charming and often affecting journey.",
]


@pytest.fixture(scope="module")
def classifier():
    return HFSentenceClassifier(load_minilm(minilm_dir()), num_classes=2).eval()


def embeddings(model, texts, max_len=32):
    batch = MiniLMTokenizer(max_len)(texts)
    with torch.no_grad():
        return F.normalize(model.embed(**batch)[0], dim=-1)


def test_shape_is_read_from_config_json():
    assert minilm_num_layers() == 6 and ffn_shape(minilm_dir()) == (384, 1536)


def test_pretrained_weights_are_loaded(classifier):
    from safetensors.torch import load_file

    state = load_file(str(minilm_dir() / "model.safetensors"))
    bert = classifier.bert
    assert classifier.bert.pooler is None and len(bert.encoder.layer) == 6
    key = "encoder.layer.2.intermediate.dense.weight"
    assert torch.equal(bert.encoder.layer[2].intermediate.dense.weight, state[key])
    assert torch.equal(bert.embeddings.word_embeddings.weight, state["embeddings.word_embeddings.weight"])


def test_keep_first_layers():
    assert len(load_minilm(minilm_dir(), 2).encoder.layer) == 2
    with pytest.raises(ValueError, match=r"num_layers \(7\) must be in \[1, 6\]"):
        load_minilm(minilm_dir(), 7)


def test_tokenizer_truncates_and_pads():
    batch = MiniLMTokenizer(8)(["hello", "one two three four five six seven eight nine"])
    tokens, valid = batch["tokens_BL"], batch["valid_BL"]
    assert tokens.shape == (2, 8) and tokens.dtype == torch.long and valid.dtype == torch.bool
    assert tokens[0, :3].tolist() == [101, 7592, 102]  # [CLS] hello [SEP]
    assert valid[0].tolist() == [True] * 3 + [False] * 5 and tokens[0, 3:].tolist() == [0] * 5
    assert valid[1].all() and tokens[1, 0] == 101 and tokens[1, -1] == 102  # truncated, [SEP] kept
    with pytest.raises(ValueError, match=r"max_len \(1\) must be >= 2"):
        MiniLMTokenizer(1)


def test_paraphrase_is_closer_than_unrelated(classifier):
    e_ND = embeddings(classifier, SENTENCES)
    sim = e_ND @ e_ND.t()
    assert sim[0, 1] > 0.5 and sim[0, 2] < 0.2 and sim[1, 2] < 0.2


def test_padding_does_not_change_embeddings(classifier):
    short = embeddings(classifier, SENTENCES[:1], max_len=16)
    long = embeddings(classifier, SENTENCES[:1], max_len=48)
    assert torch.allclose(short, long, atol=1e-5)


def test_upcycled_identical_experts_match_dense_at_eval():
    dense = HFSentenceClassifier(load_minilm(minilm_dir(), 2), num_classes=2).eval()
    moe = HFSentenceClassifier(load_minilm(minilm_dir(), 2), num_classes=2).eval()
    moe.head.load_state_dict(dense.head.state_dict())
    upcycle_hf(moe.bert, MoEConfig(num_experts=4), layers=[0, 1])
    assert isinstance(moe.bert.encoder.layer[1].intermediate, MoEBlock)
    batch = MiniLMTokenizer(24)(SENTENCES)
    with torch.no_grad():
        # Eval: every token uses >= 1 expert (top-1 fallback) and equal copies average to the dense block.
        assert torch.allclose(moe(**batch).logits, dense(**batch).logits, atol=1e-5)


def test_upcycled_layer_matches_dense_on_routed_tokens_in_training():
    torch.manual_seed(0)
    dense_layer = load_minilm(minilm_dir(), 1).encoder.layer[0]
    model = HFSentenceClassifier(load_minilm(minilm_dir(), 1), num_classes=2).train()
    upcycle_hf(model.bert, MoEConfig(num_experts=4), layers=[0])
    x_TD = torch.randn(64, 384)
    out = model.bert.encoder.layer[0].intermediate.moe(x_TD)
    routed_T = out.routing.num_selected > 0
    # 4 orthogonal gates at threshold 0: a token misses all of them with chance 1/16; both kinds occur.
    assert 0 < int(routed_T.sum()) < 64
    with torch.no_grad():
        dense_T = dense_layer.output.dense(dense_layer.intermediate(x_TD))
        assert torch.allclose(out.output[routed_T], dense_T[routed_T], atol=1e-5)
    assert torch.all(out.output[~routed_T] == 0)  # train-time k = 0: the token rides the residual


def test_upcycled_classifier_trains():
    model = HFSentenceClassifier(load_minilm(minilm_dir(), 2), num_classes=3).train()
    upcycle_hf(model.bert, MoEConfig(num_experts=2), layers=[1])
    out = model(**MiniLMTokenizer(16)(SENTENCES))
    assert out.logits.shape == (4, 3) and out.aux_loss.item() > 0
    (F.cross_entropy(out.logits, torch.tensor([0, 1, 2, 0])) + out.aux_loss).backward()
    moe = model.bert.encoder.layer[1].intermediate.moe
    assert moe.router.weight.grad is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.experts.parameters())
    assert model.bert.encoder.layer[0].intermediate.dense.weight.grad.abs().sum() > 0
    assert model.head.weight.grad is not None


def test_classifier_rejects_one_class():
    with pytest.raises(ValueError, match=r"num_classes \(1\)"):
        HFSentenceClassifier(load_minilm(minilm_dir(), 1), num_classes=1)


def test_freeze_names_map_the_short_prefixes():
    assert freeze_names(["embeddings", "layers.0", "layers.1.attn", "head", "bert.pooler"]) == [
        "bert.embeddings",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1.attn",
        "head",
        "bert.pooler",
    ]


@pytest.mark.slow
def test_matches_sentence_transformers(classifier):
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = SENTENCES + ["unflinchingly bleak and desperate", "x"]
    expected = torch.tensor(reference.encode(texts, normalize_embeddings=True))
    ours = embeddings(classifier, texts, max_len=64)
    assert (ours - expected).abs().max().item() < 1e-4
