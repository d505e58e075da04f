"""The one factory of tiny transformers models for the tests (built offline from configs, nothing downloaded),
a word-level tokenizer, and the tiny adaptive run on them (unit, distributed, integration, cluster tests).

``tiny_model(family)`` builds any family the tests use with the same small shapes (hidden 16, MLP 32,
3 blocks, 2 heads, 1 key/value head); ``save_tiny(family, directory)`` writes it as save_pretrained does.
The MoE families (MOE_FAMILIES) add 6 experts of hidden size 12, top-2: Qwen2-MoE with a shared expert,
Qwen3-MoE with a dense first layer, DeepSeek-V3 with 2 expert groups, a dense first layer and a shared
expert, gpt-oss with its sliding / full attention layers. ``randomize`` makes every weight matter.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

WORDS = "the cat dog sat ran on a mat log red big small and then".split()
NUM_LAYERS = 3
HIDDEN, MLP = 16, 32
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# The decoder families share one shape; the others spell their sizes their own way.
DECODER = dict(
    hidden_size=HIDDEN,
    intermediate_size=MLP,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
MOE_FFN, NUM_EXPERTS, TOP_K = 12, 6, 2
# Distinct sizes (D 16, F 12, 2F 24, shared 20, dense 32) make a transposed or mis-split slice fail loudly.
_MOE = dict(num_experts_per_tok=TOP_K)
MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**DECODER, "intermediate_size": MOE_FFN, "num_local_experts": NUM_EXPERTS, **_MOE},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "num_experts": NUM_EXPERTS, **_MOE}
        | {"shared_expert_intermediate_size": 20},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "num_experts": NUM_EXPERTS, **_MOE}
        | {"mlp_only_layers": [0], "norm_topk_prob": True},
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**DECODER, "intermediate_size": MOE_FFN, "num_experts": NUM_EXPERTS, **_MOE}
        | {"eos_token_id": 1, "pad_token_id": None},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "n_routed_experts": NUM_EXPERTS, **_MOE}
        | {"num_key_value_heads": 2}  # its attention repeats no key/value heads under a padding mask
        | {"n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}
        | {"routed_scaling_factor": 2.5, "norm_topk_prob": True}
        | {"kv_lora_rank": 8, "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8},
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**DECODER, "intermediate_size": MOE_FFN, "num_local_experts": NUM_EXPERTS, **_MOE}
        | {"head_dim": 8, "sliding_window": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "n_routed_experts": NUM_EXPERTS, **_MOE}
        | {"n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}
        | {"routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True},
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        {**DECODER, "intermediate_size": MOE_FFN, "num_local_experts": NUM_EXPERTS, **_MOE}
        | {"head_dim": 8, "bos_token_id": None, "eos_token_id": 1},  # its own ids lie outside a tiny vocabulary
    ),
    "mistral4": (
        "Mistral4Config",
        "Mistral4ForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "n_routed_experts": NUM_EXPERTS, **_MOE}
        | {"num_key_value_heads": 2}  # multi-head latent attention: as many key/value heads as heads
        | {"n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}
        | {"routed_scaling_factor": 2.5, "norm_topk_prob": True}
        | {"kv_lora_rank": 8, "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}
        | {"bos_token_id": None, "eos_token_id": 1, "pad_token_id": None},  # its own ids: a tiny vocabulary's
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**DECODER, "moe_intermediate_size": MOE_FFN, "num_experts": NUM_EXPERTS, **_MOE}
        | {"shared_expert_intermediate_size": 20, "head_dim": 8}
        | {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}  # both kinds of attention
        | {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8}
        | {"linear_value_head_dim": 8},
    ),
}
# family -> (config class, model class, config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", {**DECODER, "mlp_bias": True}),  # gate/up/down with biases
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", DECODER),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=HIDDEN, n_inner=MLP, n_layer=NUM_LAYERS, n_head=2, n_positions=64)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "bert": (
        "BertConfig",
        "BertForSequenceClassification",
        dict(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=NUM_LAYERS, num_attention_heads=2)
        | dict(max_position_embeddings=64, num_labels=3, **NO_DROPOUT),
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        dict(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN, intermediate_size=MLP)
        | dict(num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_labels=3, **NO_DROPOUT),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=NUM_LAYERS, num_attention_heads=2),
    ),
    **MOE_FAMILIES,
}


def tiny_config(family, vocab_size=64, **overrides):
    """The family's transformers config at the tiny shapes; ``overrides`` win (vocab_size is not a ViT field)."""
    import transformers as tf

    config_class, _, fields = FAMILIES[family]
    vocab = {} if family == "vit" else {"vocab_size": vocab_size}
    return getattr(tf, config_class)(**{**fields, **vocab, **overrides})


def tiny_model(family, vocab_size=64, seed=0, **overrides):
    """A freshly initialised tiny model of the family (seeded), in training mode."""
    import transformers as tf

    config = tiny_config(family, vocab_size, **overrides)
    torch.manual_seed(seed)
    return getattr(tf, FAMILIES[family][1])(config)


def randomize(model, seed=0, std=0.3):
    """Every floating parameter plus noise of ``std``, and every saved floating buffer (DeepSeek's
    e_score_correction_bias) drawn afresh: zero-initialised biases and routers become non-zero, so a bias
    dropped or an expert slice mis-assigned in a conversion changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
        for name, b in model.named_buffers():
            if b.is_floating_point() and name in model.state_dict():
                b.copy_(std * torch.randn(b.shape, generator=g, dtype=torch.float64).to(b.dtype))
    return model


# The config field of each MoE family that holds its expert count.
EXPERT_COUNT_KEY = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "olmoe": "num_experts",
    "deepseek_v3": "n_routed_experts",
    "gpt_oss": "num_local_experts",
    "glm4_moe": "n_routed_experts",
    "minimax_m2": "num_local_experts",
    "mistral4": "n_routed_experts",
    "qwen3_5_moe_text": "num_experts",
}


def save_moe_checkpoint(family, directory, num_experts=None, **overrides):
    """A user's MoE checkpoint: the tiny model with every weight random (routers, biases, DeepSeek's correction
    bias), written by save_pretrained in float64, next to a word-level tokenizer whose vocabulary fits it;
    returns (directory, vocabulary size)."""
    vocab = save_tokenizer(directory)
    if num_experts is not None:
        overrides[EXPERT_COUNT_KEY[family]] = num_experts
    randomize(tiny_model(family, vocab, **overrides)).double().save_pretrained(directory)
    return directory, vocab


def moe_run_settings(model_dir, text_file, world, *extra, steps=6, batch=6):
    """A float64 causal-LM run of an imported MoE checkpoint, expert parallel over the whole world (ep =
    world), an adaptive event every 3 steps, no progress bar or report: --set overrides, ``extra`` last."""
    return [
        "task.name='causal-lm'",
        f"task.path='{text_file}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        "train.precision='float64'",
        f"train.max_steps={steps}",
        f"train.global_batch_size={batch}",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "adaptive.period_steps=3",
        f"parallel.ep_size={world}",
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
        *extra,
    ]


def save_tiny(family, directory, vocab_size=64, **overrides):
    """Write the tiny model with save_pretrained (config.json + model.safetensors); returns the directory."""
    tiny_model(family, vocab_size, **overrides).save_pretrained(directory)
    return directory


def save_moe_run_files(root, family, num_experts):
    """root/<family>: the family's checkpoint with ``num_experts`` experts (save_moe_checkpoint); root/corpus.txt:
    80 lines of text. Returns root."""
    save_moe_checkpoint(family, root / family, num_experts)
    (root / "corpus.txt").write_text("\n".join(corpus_lines(80, 5)) + "\n")
    return root


def corpus_lines(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(length),), generator=g))
        for length in torch.randint(3, 12, (n,), generator=g)
    ]


def save_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return len(vocab)


# A small chat template for the word-level tokenizer (it has none of its own): every turn between role and
# end-of-turn special tokens, the generation prompt the assistant's role token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def save_chat_tokenizer(directory, template=CHAT_TEMPLATE):
    """The word-level tokenizer with role and end-of-turn special tokens and CHAT_TEMPLATE (None: without a
    template); returns the vocabulary size."""
    from transformers import AutoTokenizer

    save_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tok.chat_template = template
    tok.save_pretrained(directory)
    return len(tok)


def save_llama(directory, vocab_size):
    return save_tiny("llama", directory, vocab_size)


def save_tiny_with_tokenizer(family, directory):
    """A model directory a user would have: the tiny model and the word-level tokenizer, vocabularies matching."""
    save_tiny(family, directory, save_tokenizer(directory))
    return directory


def write_tiny_run(root):
    """The tiny LLaMA + tokenizer in root/model and its text in root/corpus.txt: (model dir, text file)."""
    root = Path(root)
    model_dir, text_file = root / "model", root / "corpus.txt"
    save_tiny_with_tokenizer("llama", model_dir)
    text_file.write_text("\n".join(corpus_lines()) + "\n")
    return str(model_dir), str(text_file)


STEPS = 12
# Every 3 steps an event (after steps 2, 5, 8, 11). 5 experts with a sparse start (threshold 0.3): some
# experts get no token in a window (removed) while some tokens find no expert (one added). min_experts = 3
# keeps at least one expert per rank at ep 3.
ADAPTIVE = ["moe.num_experts=5", "moe.min_experts=3", "moe.threshold_init=0.3", "adaptive.period_steps=3"]


def hf_model_settings(model_dir, text_file):
    """The tiny LLaMA upcycled in blocks 1 and 2, as a causal LM on text_file: the task and model overrides."""
    return [
        "task.name='causal-lm'",
        f"task.path='{text_file}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        # model.num_layers is read from the model (NUM_LAYERS blocks)
        "model.moe_layers=[1, 2]",
    ]


def hf_settings(model_dir, text_file, steps=STEPS):
    """The tiny adaptive run as --set overrides (distributed, torchrun and Ray tests)."""
    return [
        *hf_model_settings(model_dir, text_file),
        "model.freeze=['model.embed_tokens', 'model.layers.0']",
        *ADAPTIVE,
        "train.precision='float64'",
        f"train.max_steps={steps}",
        "train.global_batch_size=6",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
    ]


def train(cmd_prefix, out_dir, settings):
    """Run a training command (`python -m dynmoe_dist.train`, `launcher/torchrun.sh N`) with --set settings;
    its metrics.jsonl records."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    out_dir = Path(out_dir)
    cmd = [*cmd_prefix, "--out-dir", str(out_dir)]
    for setting in settings:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def changes(records):
    """(step, layer, removed, added ids, expert count) of each event that removed or added experts: what
    must agree across world sizes. Moves and imbalance depend on the ep size, and so does whether a layer
    whose experts only moved logs an event at all."""
    return [
        (r["step"], r["layer"], r["removed"], [a["expert"] for a in r["added"]], r["num_experts"])
        for r in records
        if r["kind"] == "event" and (r["removed"] or r["added"])
    ]


def train_recorded(trainer, steps):
    """Train `steps` steps with a collective coordinator -> (adaptive controller, losses, expert counts,
    changes of the events), what the HF invariance tests compare across world sizes."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.run import adaptive_controller, step_once

    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    losses, counts, events = [], [], []
    for _ in range(steps):
        record, new_events = step_once(trainer, adaptive, [])
        losses.append(record["loss"])
        counts.append(record["num_experts"])
        events += changes(new_events)  # removals and additions (moves depend on the ep size)
    return adaptive, losses, counts, events


def train_saving(settings, out, steps, save_at=None, resume=""):
    """A run of ``settings`` into ``out`` to ``steps`` steps, resumed from ``resume`` first (else calibrated as a
    fresh start) and checkpointed after ``save_at`` steps: (the Trainer, step -> loss, the events' expert changes,
    the checkpoint's directory or None)."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, calibrate_at_start, step_once

    trainer = Trainer(load_config(None, [*settings, f"output.out_dir='{out}'", f"output.resume='{resume}'"]))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    checkpoints = trainer.checkpoint_manager(adaptive)
    if resume:
        checkpoints.resume(resume)
    else:
        calibrate_at_start(trainer)
    losses, events, saved = {}, [], None
    while trainer.step < steps:
        record, new_events = step_once(trainer, adaptive, [])
        losses[record["step"]] = record["loss"]
        events += changes(new_events)
        if trainer.step == save_at:
            saved = checkpoints.save(trainer.step)
    return trainer, losses, events, saved
