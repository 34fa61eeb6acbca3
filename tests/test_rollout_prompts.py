"""rollout.prompts: a JSONL of prompts for on-policy rollouts. Its lines tokenised with the run's tokenizer (a tiny
character-level one built here, with and without a chat template) against ids written out by hand; each prompt its last
rollout.prompt_tokens tokens; training sample i continues line i mod lines whatever batch it is in; every refusal is
one line (exit status 2 through the command line) naming the file and the line, before any model is built; an
on-policy smoke run from a prompts file finishes, and its rollouts start with the file's prompts."""
from __future__ import annotations

import json
import re

import pytest
import tokenizers
import torch
from tokenizers import decoders, models as tk_models, pre_tokenizers

import kdexp.distributed as kd
from _launch import REPO, kdexp_run, metrics, run_env, summary
from _lone_process import lone_process
from kdexp import models, objective
from kdexp.config import validate
from kdexp.config.schema import RolloutConfig
from kdexp.data import Tokenizer, tokenize_prompts
from kdexp.rules import ConfigError
from test_config import cfg_of

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + CHARS)}  # a character is one token: ids by hand
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _backend() -> tokenizers.Tokenizer:
    b = tokenizers.Tokenizer(tk_models.WordLevel(VOCAB, unk_token="<|endoftext|>"))
    b.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    b.decoder = decoders.Fuse()
    b.add_special_tokens(SPECIAL)
    return b


def _ids(text: str) -> list[int]:
    """The ids of a text by hand: each special token one id, else one id per character."""
    out, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIAL if text.startswith(s, i)), None)
        out.append(VOCAB[special or text[i]])
        i += len(special) if special else 1
    return out


@pytest.fixture
def chat_tokenizer(tmp_path) -> Tokenizer:
    """The tiny tokenizer saved as transformers saves a chat checkpoint's, loaded as a run loads data.tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=_backend(), eos_token="<|endoftext|>", chat_template=TEMPLATE)
    hf.save_pretrained(tmp_path / "tok")
    return Tokenizer.from_dir(tmp_path / "tok")


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_text_prompts_keep_their_last_prompt_tokens(tmp_path):
    tok = Tokenizer(_backend(), VOCAB["<|endoftext|>"], source="bpe")  # no chat template
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Hello, world"}, "", {"prompt": "<|im_start|>abcdefg"}])
    got = tokenize_prompts(path, tok, 5)
    assert got.dtype == torch.int64 and got.tolist() == [_ids("world"), _ids("cdefg")]
    assert tokenize_prompts(path, tok, 8).tolist()[1] == _ids("<|im_start|>abcdefg")  # exactly 8 tokens: all kept


def test_messages_go_through_the_chat_template_with_the_generation_prompt(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = _write(tmp_path / "p.jsonl", [{"messages": messages}, {"prompt": "what is 2+2? it is"}])
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    want = _ids(rendered)
    assert len(want) == 42  # 19 + 12 + 11: each special token one id
    got = tokenize_prompts(path, chat_tokenizer, 18)
    assert got.tolist() == [want[-18:], _ids("what is 2+2? it is")]
    assert chat_tokenizer.decode(got[0]) == "\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def _refusal(fn) -> str:
    with pytest.raises(ValueError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_messages_line_without_a_chat_template_names_the_file_and_line(tmp_path):
    tok = Tokenizer(_backend(), VOCAB["<|endoftext|>"], source="bpe")
    path = _write(tmp_path / "p.jsonl", [{"prompt": "long enough"}, {"messages": [{"role": "user", "content": "x"}]}])
    message = _refusal(lambda: tokenize_prompts(path, tok, 4))
    assert message.startswith(f"rollout.prompts={path!r}: line 2 has \"messages\"") and "no chat template" in message


def test_a_prompt_shorter_than_prompt_tokens_names_the_file_line_and_length(tmp_path, chat_tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "long enough"}, {"prompt": "short"}])
    with pytest.raises(ConfigError) as err:
        tokenize_prompts(path, chat_tokenizer, 6)
    assert str(err.value).startswith(f"rollout.prompts={path!r}: line 2 is 5 tokens long, shorter than "
                                     "rollout.prompt_tokens=6")


ON = ["rollout=on_policy", "trainer.seq_length=64"]
BAD_FILES = [
    (None, "must be a JSONL file of prompts; there is no such file"),
    (['{"prompt": "a"}', '{"prompt": "b"'], "line 2 is not JSON"),
    (['{"prompt": "a"}', '{"text": "b"}'], 'line 2 must be an object with "prompt"'),
    (['{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}'], "line 1 must be an object"),
    (['{"messages": [{"role": "user"}]}'], "line 1 must be an object"),
    (['{"prompt": ""}'], "line 1 must be an object"),
    (['["a"]'], "line 1 must be an object"),
    (["", "  "], "holds no prompt"),
]


@pytest.mark.parametrize("rows, allowed", BAD_FILES)
def test_a_bad_prompts_file_is_one_line_naming_the_line(tmp_path, rows, allowed):
    path = str(tmp_path / "missing.jsonl") if rows is None else _write(tmp_path / "p.jsonl", rows)
    message = _refusal(lambda: validate(cfg_of(*ON, f"rollout.prompts={path}")))
    assert message.startswith(f"rollout.prompts={path!r} is invalid: {allowed}"), message


def test_prompts_are_refused_with_rollout_off(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    message = _refusal(lambda: validate(cfg_of(f"rollout.prompts={path}")))
    assert re.match(r"rollout.prompts='.*' is invalid: is read by rollout=on_policy only: leave it at null", message)
    validate(cfg_of(*ON, f"rollout.prompts={path}"))


def test_a_training_sample_takes_line_sample_index_mod_lines(monkeypatch):
    """The prompt of a global sample is a function of its index alone, so neither its batch nor the data-parallel
    split moves it (or its continuation: the sampler's stream is per sample)."""
    with lone_process(seed=5, monkeypatch=monkeypatch):
        kd.reseed(7)
        student = models.build(models.get_spec("tiny-student", vocab_size=64, max_position_embeddings=32))
        prompts = torch.arange(5 * 3).reshape(5, 3) + 4
        r = objective.Rollouts(RolloutConfig(name="on_policy", on_policy_fraction=1.0, prompt_tokens=3,
                                             max_new_tokens=4), seed=11, eos_id=None, prompts=prompts)
        dataset = torch.randint(4, 64, (4, 16), generator=torch.Generator().manual_seed(0))
        whole = r.sample(student, {"tokens": dataset, "sample_index": torch.tensor([3, 4, 5, 12])}, step=2)
        assert whole["tokens"][:, :3].tolist() == prompts[[3, 4, 0, 2]].tolist()
        half = r.sample(student, {"tokens": dataset[2:], "sample_index": torch.tensor([5, 12])}, step=2)
        assert torch.equal(half["tokens"], whole["tokens"][2:])
        ref = models.generate(student, prompts[[3, 4, 0, 2]], max_new_tokens=4,
                              seeds=models.rollout_seeds(11, 2, [3, 4, 5, 12]))
        assert torch.equal(whole["tokens"], ref.tokens[:, :-1])


# docs/on-policy.md's command, from the repository root: the example prompts file shipped with the repository
EXAMPLE = "examples/onpolicy_prompts.jsonl"
SMOKE = ["experiment=smoke", "rollout=on_policy", f"rollout.prompts={EXAMPLE}", "rollout.prompt_tokens=6",
         "rollout.max_new_tokens=8", "rollout.warmup_steps=1", "trainer.max_steps=3"]


@pytest.mark.slow
def test_a_short_prompt_through_the_command_line_is_one_line_exit_2_before_any_model(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "The with statement is used to wrap"}, {"prompt": "H"}])
    cache = tmp_path / "cache"
    r = kdexp_run([*SMOKE, f"rollout.prompts={path}", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"],
                  run_env(cache), tmp_path, check=False)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-4000:])
    assert r.stderr.splitlines() == [f"kdexp: error: rollout.prompts={path!r}: line 2 is 1 tokens long, shorter than "
                                     "rollout.prompt_tokens=6 (every prompt keeps its last prompt_tokens tokens): "
                                     "lower rollout.prompt_tokens or lengthen the prompt"]
    assert not list(cache.rglob("*.pt")) and not list(cache.rglob("*.safetensors")), "a model was built or trained"


@pytest.mark.slow
def test_an_on_policy_smoke_run_from_a_prompts_file(env, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    kdexp_run([*SMOKE, f"hydra.run.dir={run_dir}"], env, REPO)
    assert summary(run_dir)["status"] == "finished"
    train = metrics(run_dir, "train")
    assert [x["rollout/on_policy_fraction"] for x in train] == [0.0, 1.0, 1.0]
    assert all(1 <= x["rollout/length"] <= 8 for x in train[1:])

    # the same config's setup, in this process: its rollouts start with the file's prompts, by global sample index
    from kdexp.train import loop
    from kdexp.train.step import rollout_micro_batches

    monkeypatch.setenv("KDEXP_CACHE", env["KDEXP_CACHE"])
    path = str(REPO / EXAMPLE)
    cfg = cfg_of(*SMOKE, f"rollout.prompts={path}", "logger=none")
    validate(cfg)
    texts = [json.loads(line)["prompt"] for line in open(path)]
    with lone_process(seed=1, monkeypatch=monkeypatch):
        s = loop.setup(cfg)
        want = [s.data.tokenizer.encode(t)[-6:] for t in texts]
        batch = {"tokens": torch.zeros(4, 64, dtype=torch.int64), "sample_index": torch.tensor([5, 6, 7, 8])}
        rolled = rollout_micro_batches(s.student, s.objective, [batch], step=1)[0]
    assert len(texts) == 4 and rolled["tokens"][:, :6].tolist() == [want[1], want[2], want[3], want[0]]
    assert s.data.tokenizer.decode(want[1]) == texts[1][-len(s.data.tokenizer.decode(want[1])):]  # the end of it
    assert rolled["loss_mask"][:, :5].sum() == 0 and rolled["loss_mask"][:, 5].sum() == 4


def test_the_runs_identity_holds_the_prompts_files_content(tmp_path):
    """An edited prompts file at the same path is another run (a sweep must not reuse the old one's result)."""
    from kdexp.config import config_hash
    from test_config import cfg_of

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c d e f g h"}\n')
    first = config_hash(cfg_of("rollout=on_policy", f"rollout.prompts={f}"))
    assert config_hash(cfg_of("rollout=on_policy", f"rollout.prompts={f}")) == first
    f.write_text('{"prompt": "h g f e d c b a"}\n')
    assert config_hash(cfg_of("rollout=on_policy", f"rollout.prompts={f}")) != first
