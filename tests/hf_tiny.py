"""A tiny LLaMA and a word-level tokenizer, built offline, for the Hugging Face tests (unit and distributed)."""

import torch

WORDS = "the cat dog sat ran on a mat log red big small and then".split()
NUM_LAYERS = 3


def corpus_lines(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(length),), generator=g))
            for length in torch.randint(3, 12, (n,), generator=g)]


def save_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return len(vocab)


def save_llama(directory, vocab_size):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(directory)
