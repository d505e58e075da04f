"""Conversations in, token ids with the assistant's tokens marked out: the token cache's 'chat' format.

A record (a JSON line, a parquet / arrow row) holds either
  messages             a list of {"role": ..., "content": ...} (the chat format of transformers and TRL), or
  prompt, completion   strings (a user turn and the assistant's answer) or lists of messages (TRL's
                       conversational prompt-completion form).
Only role and content of a message are read; both must be strings, and at least one turn is the assistant's.

Rendering uses the tokenizer's own chat template (``apply_chat_template``) or the one of task.chat_template.
The assistant's part of the rendered text is found by rendering twice per assistant turn i: the conversation
before it with the generation prompt (what the model is given at inference) and the conversation through it.
The text between the two is the assistant's content and whatever the template puts after it (its end-of-turn
token), trailing whitespace left out. That needs a template that renders a conversation as a growing prefix
(ChatML, Llama 3, Mistral, SmolLM2 ... do); one that does not is refused with its row named.

Each piece of the text is tokenised on its own (add_special_tokens=False: the template writes the special
tokens), so the prompt's tokens are exactly those inference gives the model and the marked tokens decode to
exactly the assistant's text. In the cache a marked token carries LOSS_BIT (the top bit of its uint32;
vocabularies are far smaller): the token cache keeps one token file, checked like every other entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

LOSS_BIT = np.uint32(1 << 31)
ID_MASK = np.uint32((1 << 31) - 1)
COLUMNS = ("messages", "prompt", "completion")
ASSISTANT = "assistant"
Message = Dict[str, str]


def _turns(value: Any, role: str, column: str) -> List[Any]:
    """prompt / completion: a string is one turn of ``role``; a list is already messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ValueError(f"{column!r} must be a string or a list of messages, got {type(value).__name__} ({value!r:.60})")


def conversation_of(record: Dict[str, Any]) -> List[Message]:
    """The messages of one record (role and content only); ValueError saying what is wrong with it."""
    messages = record.get("messages")
    if messages is None:
        prompt, completion = record.get("prompt"), record.get("completion")
        if prompt is None or completion is None:
            keys = sorted(k for k, v in record.items() if v is not None)
            raise ValueError(f"no 'messages', and no 'prompt' with 'completion' (keys: {keys})")
        messages = _turns(prompt, "user", "prompt") + _turns(completion, ASSISTANT, "completion")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list of {{role, content}}, got {messages!r:.60}")
    for i, message in enumerate(messages):
        ok = isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))
        if not ok:
            raise ValueError(f"message {i} needs a string 'role' and 'content', got {message!r:.80}")
    if not any(m["role"] == ASSISTANT for m in messages):
        raise ValueError(f"no assistant turn (roles: {[m['role'] for m in messages]})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_segments(tokenizer, template: Optional[str], messages: List[Message]) -> List[Tuple[str, bool]]:
    """The rendered conversation as (text, is the assistant's) pieces, in order; they join to the full text."""

    def render(turns: List[Message], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(
                turns, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as err:  # a template's own raise_exception ("roles must alternate"), or a bad one
            raise ValueError(f"the chat template refuses it: {' '.join(str(err).split())}") from None

    full, pieces, cursor = render(messages, False), [], 0
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(through) and through.startswith(before) and len(before) >= cursor):
            raise ValueError(
                f"the chat template does not render message {i} as a continuation of the conversation before it "
                "(with the generation prompt), so its assistant tokens cannot be found; set task.chat_template "
                "to a template that does"
            )
        end = max(len(before), len(through.rstrip()))
        pieces += [(full[cursor : len(before)], False), (full[len(before) : end], True)]
        cursor = end
    pieces.append((full[cursor:], False))
    return [(text, marked) for text, marked in pieces if text]


def marked_ids(tokenizer, pieces: Sequence[Tuple[str, bool]]) -> List[int]:
    """Token ids of the pieces, in order, with LOSS_BIT on the assistant's."""
    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    bit = int(LOSS_BIT)
    return [t | bit if marked else t for ids, (_, marked) in zip(encoded, pieces) for t in ids]


def tokenise_record(tokenizer, template: Optional[str], record: Dict[str, Any]) -> List[int]:
    return marked_ids(tokenizer, render_segments(tokenizer, template, conversation_of(record)))


def chat_columns(column_names: Sequence[str], file: Path) -> List[str]:
    """The columns a chat file is read from; ValueError naming the file when it has neither form."""
    present = [c for c in COLUMNS if c in column_names]
    if "messages" not in present and not {"prompt", "completion"} <= set(present):
        raise ValueError(
            f"{file}: no column 'messages', and not both 'prompt' and 'completion' (columns: {list(column_names)})"
        )
    return present


def loss_tokens(ids: Sequence[int]) -> int:
    """Targets of one example: its marked tokens after the first (the first token is never predicted)."""
    return sum(1 for t in ids[1:] if t & int(LOSS_BIT))


def unpack(tokens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Stored tokens -> (token ids int64, marked bool)."""
    return (tokens & ID_MASK).astype(np.int64), (tokens & LOSS_BIT) != 0
