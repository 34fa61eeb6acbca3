"""The Hugging Face export generates on its own: a tiny student exported with the run's tokenizer (the embedded
default's shipped BPE, and a checkpoint tokenizer with a chat template and its own generation config) is loaded by
AutoTokenizer / AutoModelForCausalLM in a subprocess that never imports kdexp (tests/_generate_hf.py), which encodes a
prompt, generates, and stops at the exported eos id."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _lone_process import lone_process
from kdexp import assets, models
from kdexp.data.tokenizer import Tokenizer
from kdexp.config.qwen3 import Qwen3Spec

GENERATE = str(Path(__file__).with_name("_generate_hf.py"))
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _export(tokenizer: Tokenizer, out: Path) -> Path:
    from kdexp.train.loop import export_hf

    spec = Qwen3Spec(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_embeddings=True, max_position_embeddings=64)
    with lone_process(seed=3):
        export_hf(models.build(spec), out, tokenizer)
    return out


def _generate(path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, GENERATE, str(path)], cwd=path.parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stops_at_eos(out: dict, eos: int) -> None:
    assert not out["kdexp_imported"]
    assert out["prompt_ids"] and out["decoded"] == out["prompt"]  # a real encoding, not the empty tokenizer's []
    assert out["eos_token_id"] == eos and eos in out["generation_eos"]
    assert len(out["free"]) == 8 and eos not in out["free"]  # min_new_tokens: what the model says, eos held back
    k = out["stop_at"]
    # the same greedy tokens up to the forced eos, and not one token after it
    assert out["stopped"] == out["free"][:k - 1] + [eos]


def test_the_embedded_defaults_export_generates_and_stops_at_eos(tmp_path):
    tok = Tokenizer.from_dir(assets.SHIPPED_TEACHER)
    assert tok.eos == tok.eod == tok.backend.token_to_id("<|endoftext|>")  # the BPE's only special token
    path = _export(tok, tmp_path / "student_hf")
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
            "model.safetensors"} <= {p.name for p in path.iterdir()}
    out = _generate(path)
    _stops_at_eos(out, tok.eod)
    assert out["pad_token_id"] == out["generation_pad"] == tok.eod and not out["chat_template"]


def test_a_checkpoint_tokenizer_exports_its_chat_template_and_generation_ids(tmp_path):
    """A Qwen-style tokenizer dir: chat tokens, eos <|im_end|> (a turn's end), pad <|endoftext|> (the run's
    end-of-document token), a chat template, and a generation_config.json with sampling defaults."""
    src = tmp_path / "teacher"
    src.mkdir()
    backend = Tokenizer.from_dir(assets.SHIPPED_TEACHER).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.save(str(src / "tokenizer.json"))
    im_end = backend.token_to_id("<|im_end|>")
    (src / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 0], "temperature": 0.6}))
    tok = Tokenizer.from_dir(src)
    assert tok.eod == 0  # documents end with <|endoftext|>; a turn with <|im_end|>
    path = _export(tok, tmp_path / "student_hf")
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [im_end, 0], "pad_token_id": 0, "temperature": 0.6}
    out = _generate(path)
    assert out["chat_template"] and out["prompt"].endswith("<|im_start|>assistant\n")
    assert backend.token_to_id("<|im_start|>") in out["prompt_ids"]
    _stops_at_eos(out, im_end)
    assert out["generation_eos"] == [im_end, 0] and out["generation_pad"] == 0


def test_a_trained_bpe_without_a_source_dir_exports_its_backend(tmp_path):
    from kdexp.data.tokenizer import train_bpe

    tok = train_bpe(["the cat sat on the mat. " * 20, "a dog ran in the park. " * 20], 600)
    files = tok.hf_files(max_length=64)
    assert json.loads(files["tokenizer.json"]) == json.loads(tok.backend.to_str())
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": tok.eod, "pad_token_id": tok.eod}
    config = json.loads(files["tokenizer_config.json"])
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>" and config["model_max_length"] == 64


def test_save_hf_refuses_a_file_name_outside_the_checkpoint(tmp_path):
    spec = Qwen3Spec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, tie_embeddings=True, max_position_embeddings=64)
    with lone_process(seed=3):
        with pytest.raises(ValueError, match="not a file name"):
            models.save_hf(models.build(spec), tmp_path / "out", spec, files={"../escape.json": b"{}"})
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp dir left
