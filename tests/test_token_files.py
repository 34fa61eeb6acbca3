"""Data, tokenizer and model agree before any model is built: kdexp.data.preprocess records the tokenizer and the
largest token id beside the token files (kdexp.config.tokens), and a run refuses, with one line and exit status 2, a
corpus whose ids fall outside the models' vocabulary and a corpus made by another tokenizer (naming both)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from kdexp import assets
from kdexp.config import tokens, validate
from kdexp.data.preprocess import main as preprocess
from kdexp.data.tokenizer import train_bpe

TEXTS = ["The cat sat on the mat and looked at the door.", "A dog ran in the park, past the old stone wall.",
         "Numbers: 12, 345, 6789 and some punctuation!?"] * 8


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _checkpoint(path, vocab):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": True}))
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The corpus tokenized by the shipped teacher's BPE (2,048 ids) and by a small BPE trained here (other ids)."""
    d = tmp_path_factory.mktemp("token_files")
    with open(d / "corpus.jsonl", "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    small = d / "small_tok"
    train_bpe(TEXTS, 600).save(small)
    for name, tok in (("shipped", assets.SHIPPED_TEACHER), ("small", small)):
        assert preprocess(["--input", str(d / "corpus.jsonl"), "--tokenizer", str(tok),
                           "--output-prefix", str(d / name)]) == 0
    return d


def test_the_record_names_the_tokenizer_and_the_largest_id(corpora):
    record = tokens.read(corpora / "shipped")
    assert record["tokenizer"]["id"] == tokens.tokenizer_id(assets.SHIPPED_TEACHER)
    assert record["tokenizer"]["vocab_size"] == 2048 and record["documents"] == len(TEXTS)
    from kdexp.data.indexed import read_indexed

    ds = read_indexed(corpora / "shipped")  # the recorded maximum is the tokens' (a scan here, not in the run)
    assert record["max_token_id"] == max(int(ds[i].max()) for i in range(len(ds)))
    assert record["tokens"] == sum(len(ds[i]) for i in range(len(ds)))
    assert tokens.tokenizer_id(corpora / "small_tok") != record["tokenizer"]["id"]


def test_the_same_tokenizer_and_vocabulary_pass(corpora):
    validate(_cfg("data=indexed", f"data.prefixes=[{corpora}/shipped]", f"data.tokenizer={assets.SHIPPED_TEACHER}"))
    # a corpus made elsewhere (no record) is checked for its files only; kdexp.data says so when it opens it
    for ext in (".bin", ".idx"):
        (corpora / f"foreign{ext}").write_bytes((corpora / f"shipped{ext}").read_bytes())
    validate(_cfg("data=indexed", f"data.prefixes=[{corpora}/foreign]", f"data.tokenizer={assets.SHIPPED_TEACHER}"))
    assert tokens.unrecorded([str(corpora / "foreign"), str(corpora / "shipped")]) == [str(corpora / "foreign")]


def test_a_corpus_beyond_the_models_vocabulary_is_refused(corpora, tmp_path):
    """Both checkpoints have 1,024 vocabulary rows; the corpus (the shipped BPE's, the run's own tokenizer) holds
    ids up to the 2,000s."""
    teacher, student = _checkpoint(tmp_path / "t", 1024), _checkpoint(tmp_path / "s", 1024)
    cfg = _cfg("data=indexed", f"data.prefixes=[{corpora}/shipped]", f"data.tokenizer={assets.SHIPPED_TEACHER}",
               "model.teacher=null", "model.student=null", f"model.teacher_path={teacher}",
               f"model.student_path={student}")
    biggest = tokens.read(corpora / "shipped")["max_token_id"]
    assert biggest >= 1024
    with pytest.raises(ValueError) as err:
        validate(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"data.prefixes=['{corpora}/shipped'] is invalid: ")
    assert f"holds token id {biggest}" in line and "vocabulary of 1024" in line
    assert f"model.student_path={student} has a vocabulary" in line  # the smaller (here: equal) one, named


def test_a_corpus_of_another_tokenizer_is_refused_naming_both(corpora):
    cfg = _cfg("data=indexed", f"data.prefixes=[{corpora}/small]", f"data.tokenizer={assets.SHIPPED_TEACHER}")
    with pytest.raises(ValueError) as err:
        validate(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"data.prefixes=['{corpora}/small'] is invalid: ")
    assert f"tokenized by '{corpora / 'small_tok'}'" in line
    assert f"this run's tokenizer is data.tokenizer='{assets.SHIPPED_TEACHER}'" in line
    # the same refusal for separate validation data
    cfg = _cfg("data=indexed", f"data.prefixes=[{corpora}/shipped]", f"data.valid_prefixes=[{corpora}/small]",
               f"data.tokenizer={assets.SHIPPED_TEACHER}")
    with pytest.raises(ValueError, match=r"^data.valid_prefixes=.* tokenized by"):
        validate(cfg)


def test_the_run_refuses_it_with_one_line_and_exit_2_before_building_anything(corpora, tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "kdexp.run", "data=indexed", f"data.prefixes=[{corpora}/small]",
                        f"data.tokenizer={assets.SHIPPED_TEACHER}", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdexp: error: data.prefixes=") and "tokenized by" in lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
