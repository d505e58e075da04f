"""A byte-level BPE tokenizer trained on a corpus with the `tokenizers` library, saved as a transformers
tokenizer (tokenizer.json + tokenizer_config.json) that ``AutoTokenizer.from_pretrained`` loads offline.

Byte-level (GPT-2's scheme: every byte has a token, words keep their leading space) so that any text,
code and non-ASCII included, encodes and decodes back to itself with no unknown token; one special
token, EOS, which the token cache puts between documents and generation stops at. It is the pad token
too: the model never trains on padding (the causal-lm task packs full windows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS = "<|endoftext|>"
MIN_VOCAB = 300
"""256 byte tokens + EOS + a few merges: below this BPE has nothing to learn."""


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """A transformers fast tokenizer whose BPE merges are learned from ``texts``; EOS is id 0."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"tokenizer vocabulary ({vocab_size}) must be >= {MIN_VOCAB} (256 bytes + EOS + merges)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen in the corpus or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)


def save_tokenizer(tokenizer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """The model's embedding rows: the tokenizer's size rounded up to a multiple (the matmuls like it)."""
    return -(-vocab_size // multiple) * multiple
