"""Packing changes nothing a conversation learns: task 'chat''s packed sequences (position ids restarting per
conversation, transformers' block-diagonal mask through HFCausalLM) give the summed assistant-token loss and
the gradients of every parameter that the conversations give one at a time, unpadded: in float32 to 1e-6 of
each tensor's largest value, for an upcycled LLaMA and an imported Qwen3-MoE (its own routing, and converted
to top-any); in float64 to 1e-12 (the packing is exact, float32 only sums in another order). Every decoder
family the tests build either makes its attention block-diagonal from the position ids in transformers' own
forward or is refused by task 'chat' in one line (gpt-oss builds its masks without them)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, WORDS, save_chat_tokenizer, tiny_model  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.data.chat import unpack  # noqa: E402
from dynmoe_dist.data.packed import IGNORE  # noqa: E402
from dynmoe_dist.models.build import build_model, check_packed_attention  # noqa: E402
from dynmoe_dist.models.hf.families import packs_by_position_ids  # noqa: E402
from dynmoe_dist.tasks import build_task  # noqa: E402
from dynmoe_dist.train.parts import build_parts  # noqa: E402

MAX_LEN = 40
CASES = {
    "llama upcycled": ("llama", ["model.moe_layers=[1, 2]"]),
    "qwen3_moe native": ("qwen3_moe", []),
    "qwen3_moe top_any": ("qwen3_moe", ["moe.router='top_any'"]),
}


def conversations(n, seed=0):
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, size=k))

    out = []
    for _ in range(n):
        turns = [{"role": "user", "content": words(rng.integers(1, 6))}]
        turns.append({"role": "assistant", "content": words(rng.integers(1, 5))})
        if rng.random() < 0.4:
            turns += [{"role": "user", "content": words(2)}, {"role": "assistant", "content": words(3)}]
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_pack")
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(24)))
    for family in {family for family, _ in CASES.values()}:
        vocab = save_chat_tokenizer(root / family)
        tiny_model(family, vocab).save_pretrained(root / family)
    return root


def setup(root, family, extra, precision="float32"):
    config = load_config(
        None,
        [
            "task.name='chat'",
            f"task.path='{root / 'chat.jsonl'}'",
            f"task.max_len={MAX_LEN}",
            f"task.cache_dir='{root / 'cache'}'",
            "model.source='hf'",
            f"model.path='{root / family}'",
            f"train.precision='{precision}'",
            *extra,
        ],
    )
    task = build_task(config.task)
    model = build_parts(config, build_model(config.model, config.moe, task.model_needs())).model
    return task, model


def loss_and_grads(model, task, batches):
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for inputs, targets in batches:
        loss_sum, _ = task.loss_terms(model(**inputs).logits, targets)
        loss_sum.backward()
        total += loss_sum.detach().double()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def one_at_a_time(task, split):
    """Every conversation of the split as its own unpadded batch of one, no position ids: plain causal."""
    packed = task.packed[split]
    for start, n in zip(packed.starts_D.tolist(), packed.positions_D.tolist()):
        ids, marked = unpack(np.asarray(packed.tokens[start : start + n + 1]))
        targets = np.where(marked[1:], ids[1:], IGNORE)
        yield {"input_ids": torch.from_numpy(ids[None, :-1])}, torch.from_numpy(targets[None])


@pytest.mark.parametrize(
    "case, precision, tolerance",
    [(case, "float32", 1e-6) for case in CASES] + [("qwen3_moe top_any", "float64", 1e-12)],
)
def test_packed_losses_and_gradients_equal_the_conversations_alone(files, case, precision, tolerance):
    family, extra = CASES[case]
    task, model = setup(files, family, extra, precision)
    model.train()
    packed = task.packed["train"]
    assert len(packed) < packed.num_examples  # several conversations share a sequence
    batch = task.batch("train", torch.arange(len(packed)))
    want_loss, want_grads = loss_and_grads(model, task, one_at_a_time(task, "train"))
    got_loss, got_grads = loss_and_grads(model, task, [(batch.inputs, batch.targets)])
    assert task.count_items("train", torch.arange(len(packed))) == int((batch.targets != IGNORE).sum())
    assert abs(float(got_loss - want_loss)) <= tolerance * float(want_loss)
    assert len(want_grads) > 10
    for name, param in model.named_parameters():
        zero = torch.zeros_like(param)  # padding routed to an expert no conversation reaches: a zero gradient
        got, want = got_grads.get(name, zero), want_grads.get(name, zero)
        assert float((got - want).abs().max()) <= tolerance * max(float(want.abs().max()), 1e-30), name


def test_without_restarting_positions_the_conversations_would_see_each_other(files):
    """The check above can fail: the same packed tokens as one causal sequence give a loss 20 times further
    off than its float32 tolerance (the tiny model at its initialisation leans little on the context)."""
    task, model = setup(files, "llama", ["model.moe_layers=[1, 2]"])
    batch = task.batch("train", torch.arange(len(task.packed["train"])))
    with torch.no_grad():
        packed, _ = task.loss_terms(model(**batch.inputs).logits, batch.targets)
        causal, _ = task.loss_terms(model(input_ids=batch.inputs["input_ids"]).logits, batch.targets)
    assert abs(float(packed) - float(causal)) > 20 * 1e-6 * abs(float(packed))


DECODERS = ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", *MOE_FAMILIES]


@pytest.mark.parametrize("family", DECODERS)
def test_each_family_makes_attention_block_diagonal_from_position_ids_or_is_refused(family, tmp_path):
    """transformers' own forward (float64, eager experts) on three examples packed with restarting position
    ids against each alone: equal for every family chat accepts; different for those it refuses (if
    transformers starts building their masks from the position ids, this fails: lift the refusal)."""
    moe = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    model = tiny_model(family, 64, **moe).double().eval()
    lengths = [5, 7, 3]
    examples = [torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(examples)[None], position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=e[None], use_cache=False).logits[0] for e in examples])
    apart = float((packed - alone).abs().max()) <= 1e-12
    model.save_pretrained(tmp_path)
    if not packs_by_position_ids(family):
        assert not apart
        with pytest.raises(ValueError, match=f"transformers' {family} .* builds its attention mask without them"):
            check_packed_attention(str(tmp_path))
    else:
        assert apart
        check_packed_attention(str(tmp_path))


def test_a_wrapper_model_type_packs_as_its_family_does():
    """The hub's Qwen3.5-MoE directories say model_type 'qwen3_5_moe' (the vision-language model wrapping the
    text family): its linear attention cannot be packed either; a dense model type can."""
    assert not packs_by_position_ids("qwen3_5_moe") and not packs_by_position_ids("qwen3_5_moe_text")
    assert packs_by_position_ids("llama") and packs_by_position_ids("qwen3_moe")
