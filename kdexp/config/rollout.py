"""The rollout group's value rules (``check_rollout``): where a step's tokens come from and the sampler's settings,
checked with the rest of the config before anything is built (kdexp.config.checks.validate calls it). Also the one
reader of a rollout.prompts file (``read_prompts``): its lines parsed and checked here, stdlib only; kdexp.data
tokenises them (kdexp.data.prompts)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kdexp.rules import choice, fail, integer, number, text

ROLLOUTS = ("off", "on_policy")
ESTIMATORS = ("distribution", "sampled_token")  # kdexp.objective.rollout implements them


def on_policy_step(rollout_cfg: Any, step: int) -> bool:
    """Whether training step `step` (0-based) trains on the student's samples: none before rollout.warmup_steps, then
    exactly a fraction on_policy_fraction of the steps (step k after the warmup when floor((k+1) f) > floor(k f)), a
    function of the step alone (neither the data-parallel size nor the accumulation moves it)."""
    r = rollout_cfg
    if str(r.name) != "on_policy" or step < int(r.warmup_steps):
        return False
    k, f = step - int(r.warmup_steps), float(r.on_policy_fraction)
    return math.floor((k + 1) * f) > math.floor(k * f)


def positions_per_sample(cfg: Any, step: int) -> int:
    """Sequence positions one sample of training step `step` puts through the student's training forward: the
    rollout's (prompt + new tokens, less the last token, which predicts nothing) on an on-policy step, else
    trainer.seq_length. perf/tokens_per_s and the cost record count these."""
    r = cfg.rollout
    if on_policy_step(r, step):
        return int(r.prompt_tokens) + int(r.max_new_tokens) - 1
    return int(cfg.trainer.seq_length)


def read_prompts(path: str) -> list[tuple[int, Any]]:
    """[(line number, text or messages)] of a rollout.prompts JSONL file, blank lines skipped: each line a JSON object
    with "prompt" (a string) or "messages" (a list of {"role": str, "content": str}). A ValueError of one line naming
    the file and the line otherwise, or when the file is missing or holds no prompt."""
    key = "rollout.prompts"
    file = Path(path).expanduser()
    if not file.is_file():
        fail(key, path, "must be a JSONL file of prompts; there is no such file")
    out: list[tuple[int, Any]] = []
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                fail(key, path, f"line {n} is not JSON ({err.msg})")
            prompt = row.get("prompt") if isinstance(row, dict) else None
            messages = row.get("messages") if isinstance(row, dict) else None
            if isinstance(prompt, str) and prompt and messages is None:
                out.append((n, prompt))
            elif prompt is None and isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                out.append((n, [dict(m) for m in messages]))
            else:
                fail(key, path, f'line {n} must be an object with "prompt" (a non-empty string) or "messages" (a '
                     'non-empty list of {"role": string, "content": string}), one of them')
    if not out:
        fail(key, path, "holds no prompt: each line is {\"prompt\": ...} or {\"messages\": [...]}")
    return out


def check_rollout(cfg: Any, max_positions: int) -> None:
    """rollout.*: the sampler's values (they set val/onpolicy_reverse_kl's continuations in every run), then what
    training on the student's own tokens needs (an online teacher to score them, a rollout that fits a training
    sequence, no sequence parallelism in generation)."""
    r, t = cfg.rollout, cfg.trainer
    choice("rollout.name", r.name, ROLLOUTS)
    number("rollout.on_policy_fraction", r.on_policy_fraction, ge=0, le=1)
    integer("rollout.prompt_tokens", r.prompt_tokens, ge=1)
    integer("rollout.max_new_tokens", r.max_new_tokens, ge=1)
    number("rollout.temperature", r.temperature, gt=0)
    number("rollout.top_p", r.top_p, gt=0, le=1)
    choice("rollout.estimator", r.estimator, ESTIMATORS)
    integer("rollout.warmup_steps", r.warmup_steps, ge=0)
    text("rollout.prompts", r.prompts, none_ok=True)
    if r.prompt_tokens > t.seq_length:
        fail("rollout.prompt_tokens", r.prompt_tokens, f"must be in [1, trainer.seq_length={t.seq_length}] (the "
             "prompt is the start of a dataset sample; it also starts val/onpolicy_reverse_kl's continuations)")
    if r.prompt_tokens + r.max_new_tokens > max_positions:
        fail("rollout.max_new_tokens", r.max_new_tokens, f"must be in [1, {max_positions - r.prompt_tokens}]: "
             f"rollout.prompt_tokens + rollout.max_new_tokens must be <= the models' max_position_embeddings "
             f"{max_positions}")
    if r.name == "off":
        if r.on_policy_fraction != 0:
            fail("rollout.on_policy_fraction", r.on_policy_fraction, "must be 0 with rollout=off (dataset batches "
                 "only); choose rollout=on_policy to train on the student's samples")
        for key, default in (("estimator", "distribution"), ("warmup_steps", 0), ("prompts", None)):
            if getattr(r, key) != default:
                shown = "null" if default is None else default
                fail(f"rollout.{key}", getattr(r, key), f"is read by rollout=on_policy only: leave it at {shown} "
                     "with rollout=off, or choose rollout=on_policy")
        return
    if r.prompt_tokens + r.max_new_tokens > t.seq_length:
        fail("rollout.max_new_tokens", r.max_new_tokens, f"must be in [1, {t.seq_length - r.prompt_tokens}] with "
             f"rollout=on_policy: a rollout (rollout.prompt_tokens={r.prompt_tokens} + max_new_tokens) must fit in "
             f"trainer.seq_length={t.seq_length}, the sequence the plan sizes")
    if r.warmup_steps > t.max_steps:
        fail("rollout.warmup_steps", r.warmup_steps, f"must be in [0, trainer.max_steps={t.max_steps}]")
    if cfg.teacher.name != "online":
        fail("teacher.name", cfg.teacher.name, "must be online with rollout=on_policy: the teacher scores the "
             "student's own samples, which no offline cache holds")
    if cfg.parallel.sequence:
        fail("parallel.sequence", True, "must be false with rollout=on_policy: generation has one token per row to "
             "split over the tensor-parallel ranks")
    if r.prompts is not None:
        read_prompts(r.prompts)  # the tokens are checked where the tokenizer is (kdexp.data.prompts)
