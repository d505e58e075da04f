"""A chat run end to end in one process: a tokenizer without a chat template trains with task.chat_template,
its checkpoint keeps the template with the tokenizer, and the export (with the base model moved away: the
checkpoint alone) renders a conversation with it, as the run did."""

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_tiny import CHAT_TEMPLATE, WORDS, save_chat_tokenizer, save_tiny  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.export import main as export_main  # noqa: E402
from dynmoe_dist.train.checkpoint import last_complete_checkpoint  # noqa: E402
from dynmoe_dist.train.run import run  # noqa: E402


def test_the_export_carries_the_runs_chat_template(tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    save_tiny("llama", model_dir, save_chat_tokenizer(model_dir, template=None))
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    records = [
        {"messages": [{"role": "user", "content": " ".join(WORDS[i : i + 3])}, {"role": "assistant", "content": w}]}
        for i, w in enumerate(WORDS[:12])
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config(
        None,
        [
            "task.name='chat'",
            f"task.path='{tmp_path / 'chat.jsonl'}'",
            f"task.chat_template='{tmp_path / 'chat.jinja'}'",
            "task.max_len=24",
            f"task.cache_dir='{tmp_path / 'cache'}'",
            "model.source='hf'",
            f"model.path='{model_dir}'",
            "model.moe_layers=[1]",
            "train.max_steps=2",
            "train.global_batch_size=2",
            f"output.out_dir='{tmp_path / 'run'}'",
            "output.report=false",
            "output.tensorboard=false",
            "output.progress=false",
        ],
    )
    run(config)
    checkpoint = last_complete_checkpoint(config.output.out_dir)
    assert (checkpoint / "model" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    shutil.move(model_dir, tmp_path / "moved")  # the export reads the checkpoint alone
    export_main([str(checkpoint), "--out", str(tmp_path / "export")])
    capsys.readouterr()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    question = records[0]["messages"][:1]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|user|> {question[0]['content']} <|end|>\n<|assistant|> "
