"""The prompts of on-policy rollouts from a file (rollout.prompts): each line of the JSONL (read and checked by
kdexp.config.rollout.read_prompts) tokenised once with the run's tokenizer, the teacher's.

- ``{"prompt": text}``: the text's tokens (no special tokens added), as the data pipeline encodes documents;
- ``{"messages": [...]}``: rendered by the tokenizer's chat template with the generation prompt appended
  (transformers' ``apply_chat_template(..., add_generation_prompt=True)``), then tokenised like a text. A tokenizer
  without a chat template (the BPE trained on the embedded corpus) refuses such a line.

Generation takes prompts of one length (``[b, p]``, p = rollout.prompt_tokens), so each prompt keeps its last p tokens
(the end of a prompt, where the answer starts, is what a continuation needs); a prompt shorter than p is refused.
Either refusal is a ``ConfigError`` naming the file and the line: one line, exit status 2, before any model is built.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from kdexp.config.rollout import read_prompts
from kdexp.data.tokenizer import Tokenizer
from kdexp.rules import ConfigError

__all__ = ["tokenize_prompts"]


def tokenize_prompts(path: str, tokenizer: Tokenizer, prompt_tokens: int) -> torch.Tensor:
    """[lines, prompt_tokens] int64: each prompt of the file at `path` tokenised, its last `prompt_tokens` tokens."""
    rows = []
    render = None
    for n, prompt in read_prompts(path):
        if isinstance(prompt, list):
            render = render or _chat_renderer(tokenizer, path, n)
            prompt = render(prompt)
        ids = tokenizer.encode(prompt)
        if len(ids) < prompt_tokens:
            raise ConfigError(f"rollout.prompts={path!r}: line {n} is {len(ids)} tokens long, shorter than "
                              f"rollout.prompt_tokens={prompt_tokens} (every prompt keeps its last prompt_tokens "
                              "tokens): lower rollout.prompt_tokens or lengthen the prompt")
        rows.append(ids[len(ids) - prompt_tokens:])
    return torch.tensor(rows, dtype=torch.int64)


def _chat_renderer(tokenizer: Tokenizer, path: str, line: int) -> Callable[[list], str]:
    """messages -> the text the tokenizer's chat template makes of them, the assistant's turn opened."""
    hf = _chat_tokenizer(tokenizer)
    if hf is None:
        raise ConfigError(f"rollout.prompts={path!r}: line {line} has \"messages\", but the tokenizer "
                          f"({tokenizer.source or 'trained here'}) has no chat template: write the line as "
                          "{\"prompt\": text}, or use a tokenizer with a chat template (data.tokenizer)")
    return lambda messages: hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _chat_tokenizer(tokenizer: Tokenizer):
    """The tokenizer's source checkpoint loaded by transformers (never remote code) when it has a chat template (in
    tokenizer_config.json, chat_template.jinja or chat_template.json); None otherwise."""
    source = tokenizer.source
    if not source or not os.path.isdir(source):
        return None
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    return hf if getattr(hf, "chat_template", None) else None
