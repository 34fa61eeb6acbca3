"""kdexp.data: embedded corpus, tokenizer, caches, indexed datasets, GPTDataset samples, batches().

References are independent of the code under test: raw .bin bytes read with numpy, the tokenizer applied
one document at a time, the documents themselves for sample contents, plain index arithmetic for batches.
Small corpora (a few hundred KB) keep each test at seconds.
"""

from __future__ import annotations

import json
import os

import numpy
import pytest
import torch

import kdexp.data.sources as sources_mod
from kdexp.config import DataConfig, tokens
from kdexp.data import atomic_dir, batches, build_cached, cached_path, embedded_corpus, embedded_documents
from kdexp.data import prepare as data_prepare
from kdexp.data.dataset import ReadOrder
from kdexp.data.cache import cache_dir
from kdexp.distributed.testing import free_port
from kdexp.data.indexed import read_indexed, tokenize_to_indexed
from kdexp.data.tokenizer import EOD_TOKEN, Tokenizer

SMALL = {"name": "stdlib", "vocab_size": 512, "max_chars": 300_000, "val_fraction": 0.1}
SEQ = 64


def prepare(changes: dict, **kwargs):
    """kdexp.data.prepare on the schema's data node with `changes` (as a data=... group file would give it)."""
    return data_prepare(DataConfig(**changes), **kwargs)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    bundle = prepare(SMALL, seq_length=SEQ, cache_dir=root, seed=7, train_samples=300, val_samples=20)
    return bundle, root


# ------------------------------------------------------------------------------------------------- corpus

def test_corpus_deterministic_disjoint_nonempty():
    train, val = embedded_corpus(300_000, 0.1)
    train2, val2 = embedded_corpus(300_000, 0.1)
    assert [d.name for d in train] == [d.name for d in train2] and [d.name for d in val] == [d.name for d in val2]
    assert train and val and all(d.text.strip() for d in train + val)
    assert not {d.name for d in train} & {d.name for d in val}
    assert [d.name for d in train] == sorted(d.name for d in train)
    total = sum(len(d.text) for d in train + val)
    assert total <= 300_000
    assert 0.1 * total <= sum(len(d.text) for d in val) < 0.5 * total
    for d in train + val:
        parts = d.name.split("/")
        assert not {"site-packages", "test", "tests", "encodings"} & set(parts[:-1]), d.name
    # A larger cap gives a larger corpus, mostly the same documents (selection follows a fixed hash rank).
    big_train, big_val = embedded_corpus(600_000, 0.1)
    big = {d.name for d in big_train + big_val}
    assert len(big) > len(train + val) and len({d.name for d in train + val} - big) <= len(train + val) // 4
    texts_train, texts_val = embedded_documents(300_000, 0.1)
    assert texts_train == [d.text for d in train] and texts_val == [d.text for d in val]


def test_corpus_bad_values():
    good = {"max_chars": 300_000, "val_fraction": 0.1}
    for kwargs in ({"max_chars": 10}, {"val_fraction": 0.0}, {"val_fraction": 0.7}, {"max_documents": 1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            embedded_corpus(**{**good, **kwargs})


# ---------------------------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_and_vocab(small):
    bundle, _ = small
    tok = bundle.tokenizer
    assert tok.vocab_size == SMALL["vocab_size"] == bundle.vocab_size
    assert tok.backend.id_to_token(tok.eod) == EOD_TOKEN
    _, val = embedded_corpus(SMALL["max_chars"], SMALL["val_fraction"])
    for doc in val:  # held-out text, never seen in training
        ids = tok.encode(doc.text)
        assert ids and max(ids) < tok.vocab_size and tok.eod not in ids
        assert tok.decode(ids) == doc.text
    odd = "naïve café — 日本語 \t\n  trailing  spaces  \x00"
    assert tok.decode(tok.encode(odd)) == odd
    assert tok.encode_batch([odd, "x = 1"]) == [tok.encode(odd), tok.encode("x = 1")]


def test_tokenizer_cached_not_retrained(tmp_path, monkeypatch):
    calls = []
    real = sources_mod.train_bpe
    monkeypatch.setattr(sources_mod, "train_bpe", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = dict(SMALL, max_chars=120_000)
    first = prepare(cfg, seq_length=SEQ, cache_dir=tmp_path, seed=1, train_samples=10, val_samples=2)
    tok_file = first.info["tokenizer"] + "/tokenizer.json"
    mtime = os.stat(tok_file).st_mtime_ns
    second = prepare(cfg, seq_length=SEQ, cache_dir=tmp_path, seed=1, train_samples=10, val_samples=2)
    assert len(calls) == 1
    assert os.stat(tok_file).st_mtime_ns == mtime
    assert second.tokenizer.sha256 == first.tokenizer.sha256
    # a different vocabulary is a different cache entry
    prepare(dict(cfg, vocab_size=600), seq_length=SEQ, cache_dir=tmp_path, seed=1, train_samples=10,
            val_samples=2)
    assert len(calls) == 2
    # two artefacts, each beside its lock file (.<name>.lock)
    entries = sorted(p.name for p in (tmp_path / "tokenizer").iterdir())
    assert len([e for e in entries if not e.startswith(".")]) == 2
    assert [e for e in entries if e.startswith(".")] == sorted(f".{e}.lock" for e in entries if not e.startswith("."))


# --------------------------------------------------------------------------------------- indexed dataset

def test_indexed_equals_direct_tokenization(small):
    bundle, _ = small
    tok = bundle.tokenizer
    train, val = embedded_corpus(SMALL["max_chars"], SMALL["val_fraction"])
    for split, docs in (("train", train), ("val", val)):
        prefix = f"{bundle.info['tokens']}/{split}"
        expected = [tok.encode(d.text) + [tok.eod] for d in docs]  # one document at a time, not encode_batch
        ds = read_indexed(prefix)
        assert len(ds) == len(expected)
        for i, ids in enumerate(expected):
            assert ds[i].tolist() == ids
        raw = numpy.fromfile(prefix + ".bin", dtype=numpy.uint16)  # 512-token vocab -> uint16 storage
        assert raw.tolist() == [t for ids in expected for t in ids]


def _occurs(piece: list[int], docs: list[list[int]], where: str) -> bool:
    n = len(piece)
    for d in docs:
        if where == "whole" and d == piece:
            return True
        if where == "prefix" and d[:n] == piece:
            return True
        if where == "suffix" and n <= len(d) and d[len(d) - n:] == piece:
            return True
    return False


def test_gpt_samples_are_windows_of_documents(small):
    bundle, _ = small
    tok = bundle.tokenizer
    train, _ = embedded_corpus(SMALL["max_chars"], SMALL["val_fraction"])
    docs = [tok.encode(d.text) + [tok.eod] for d in train]
    assert len(bundle.train_ds) >= 300 and len(bundle.val_ds) >= 20
    for i in range(0, 300, 37):
        item = bundle.train_ds[i]
        tokens, labels = item["tokens"].tolist(), item["labels"].tolist()
        assert len(tokens) == len(labels) == SEQ
        assert labels[:-1] == tokens[1:]
        assert item["loss_mask"].tolist() == [1.0] * SEQ
        assert item["position_ids"].tolist() == list(range(SEQ))
        # The seq+1 window, cut after each eod, is: the end of a document, whole documents, the start of one.
        window = tokens + labels[-1:]
        pieces, cur = [], []
        for t in window:
            cur.append(t)
            if t == tok.eod:
                pieces.append(cur)
                cur = []
        if cur:
            pieces.append(cur)
        if len(pieces) == 1:
            assert any(window == d[k:k + SEQ + 1] for d in docs for k in range(len(d) - SEQ))
            continue
        assert _occurs(pieces[0], docs, "suffix")
        for p in pieces[1:-1]:
            assert _occurs(p, docs, "whole")
        assert _occurs(pieces[-1], docs, "whole" if pieces[-1][-1] == tok.eod else "prefix")


def test_prepare_seed_determinism(tmp_path, small):
    bundle, root = small
    again = prepare(SMALL, seq_length=SEQ, cache_dir=tmp_path, seed=7, train_samples=300, val_samples=20)
    other = prepare(SMALL, seq_length=SEQ, cache_dir=root, seed=8, train_samples=300, val_samples=20)
    first = [bundle.train_ds[i]["tokens"] for i in range(8)]
    assert all(torch.equal(a, again.train_ds[i]["tokens"]) for i, a in enumerate(first))
    assert not all(torch.equal(a, other.train_ds[i]["tokens"]) for i, a in enumerate(first))


def test_the_samples_do_not_move_with_the_run_length(tmp_path, small):
    """data.seed fixes the training windows: one epoch of them, whatever the run reads (a run 100x longer than the
    epoch gets the same windows, not megatron's re-cut multi-epoch ones); the fingerprint names seed and length."""
    bundle, root = small
    longer = prepare(SMALL, seq_length=SEQ, cache_dir=root, seed=7, train_samples=100 * len(bundle.train_ds),
                     val_samples=20)
    assert len(longer.train_ds) == len(bundle.train_ds) and longer.fingerprint == bundle.fingerprint
    assert torch.equal(_stream(longer.train_ds, len(longer.train_ds)), _stream(bundle.train_ds, len(longer.train_ds)))
    other = prepare(SMALL, seq_length=SEQ, cache_dir=root, seed=8, train_samples=300, val_samples=20)
    assert other.fingerprint != bundle.fingerprint and other.source == bundle.source and other.seed == 8


def test_read_order_permutes_the_fixed_windows_per_epoch(small):
    """trainer.seed picks the order only: every epoch of a ReadOrder reads each of the first `windows` windows once
    (numpy's permutation of (seed, epoch), recomputed here), items are the dataset's own windows, another seed reads
    the same set in another order, and a run shorter than an epoch reads only the first windows."""
    ds = small[0].train_ds
    n = 20
    orders = {seed: ReadOrder(ds, windows=n, seed=seed, positions=2 * n + 5) for seed in (1, 2)}
    for seed, order in orders.items():
        assert len(order) == 2 * n + 5 and order.n == n
        read = [order.order(p) for p in range(2 * n + 5)]
        for e in range(3):
            want = numpy.random.default_rng([seed, e]).permutation(n)
            assert read[e * n:(e + 1) * n] == want[:len(read[e * n:(e + 1) * n])].tolist()
        assert sorted(read[:n]) == sorted(read[n:2 * n]) == list(range(n)) and read[:n] != read[n:2 * n]
        item = order[7]
        assert item["sample_index"] == read[7] and torch.equal(item["tokens"], ds[read[7]]["tokens"])
    assert [orders[1].order(p) for p in range(n)] != [orders[2].order(p) for p in range(n)]
    epochs = small[0].read_order(3 * len(ds), 5)
    assert epochs.n == len(ds) and len(epochs) == 3 * len(ds)
    short = small[0].read_order(6, 3)
    assert short.n == 6
    assert sorted(short.order(p) for p in range(6)) == list(range(6))
    b = next(batches(short, micro_batch_size=3, dp_rank=1, dp_size=2))
    assert b["sample_index"].tolist() == [short.order(p) for p in (3, 4, 5)]
    assert torch.equal(b["tokens"], _stream(ds, len(ds))[b["sample_index"]])


# ------------------------------------------------------------------------------------------------ batches

def _stream(ds, n):
    return torch.stack([ds[i]["tokens"] for i in range(n)])


def test_batches_resume_exactly(small):
    ds = small[0].train_ds
    full = torch.cat([b["tokens"] for b in batches(ds, micro_batch_size=4, dp_rank=0, dp_size=1)])
    usable = len(ds) // 4 * 4
    assert torch.equal(full, _stream(ds, usable))
    for k in (8, 13):
        tail = list(batches(ds, micro_batch_size=4, dp_rank=0, dp_size=1, start_sample=k))
        got = torch.cat([b["tokens"] for b in tail])
        assert len(tail) == (len(ds) - k) // 4
        assert torch.equal(got, _stream(ds, len(ds))[k:k + len(got)])
    b = next(batches(ds, micro_batch_size=4, dp_rank=0, dp_size=1))
    assert b["tokens"].dtype == b["labels"].dtype == torch.long and b["loss_mask"].dtype == torch.float32
    assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == (4, SEQ)


def test_batches_data_parallel_disjoint(small):
    ds = small[0].train_ds
    mbs, start = 3, 5
    ranks = [list(batches(ds, micro_batch_size=mbs, dp_rank=r, dp_size=2, start_sample=start)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == (len(ds) - start) // (2 * mbs)
    stream = _stream(ds, len(ds))
    for step, (b0, b1) in enumerate(zip(*ranks)):
        g = start + step * 2 * mbs
        assert torch.equal(b0["tokens"], stream[g:g + mbs])
        assert torch.equal(b1["tokens"], stream[g + mbs:g + 2 * mbs])
    with pytest.raises(ValueError, match="dp_rank"):
        next(batches(ds, micro_batch_size=2, dp_rank=2, dp_size=2))
    with pytest.raises(ValueError, match="start_sample"):
        next(batches(ds, micro_batch_size=2, dp_rank=0, dp_size=1, start_sample=-1))


# ------------------------------------------------------------------------------- indexed source, configs

def test_indexed_source_with_saved_tokenizer(tmp_path, small):
    bundle, _ = small
    tok = bundle.tokenizer
    # An HF-style checkpoint tokenizer dir: transformers' own save, no kdexp metadata -> eod found by name.
    from transformers import PreTrainedTokenizerFast

    hf_dir = tmp_path / "ckpt"
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=EOD_TOKEN).save_pretrained(str(hf_dir))
    loaded = Tokenizer.from_dir(hf_dir)
    assert loaded.eod == tok.eod and loaded.vocab_size == tok.vocab_size
    texts_train, _ = embedded_documents(SMALL["max_chars"], SMALL["val_fraction"])
    p1, p2 = str(tmp_path / "a"), str(tmp_path / "b")
    tokenize_to_indexed(p1, texts_train[: len(texts_train) // 2], loaded)
    tokenize_to_indexed(p2, texts_train[len(texts_train) // 2:], loaded)
    cfg = {"name": "indexed", "prefixes": [p1], "tokenizer": str(hf_dir)}
    # The schema's split "969,30,1" (no fallback of prepare's own): ~10 documents cannot give 3% to validation,
    # a clear error instead of megatron's endless loop.
    with pytest.raises(ValueError, match="data.split='969,30,1'.*validation"):
        prepare(cfg, seq_length=SEQ, cache_dir=tmp_path / "c", seed=3, train_samples=50, val_samples=5)
    cfg["split"] = "70,30,1"  # the test share is dropped, not built
    one = prepare(cfg, seq_length=SEQ, cache_dir=tmp_path / "c", seed=3, train_samples=50, val_samples=5)
    assert one.vocab_size == tok.vocab_size and one.info["source"] == "indexed"
    item = one.train_ds[0]
    assert item["tokens"].shape == (SEQ,) and item["labels"][:-1].tolist() == item["tokens"][1:].tolist()
    # The config's own spelling: weights inline in data.prefixes, as numbers.
    blend = {"name": "indexed", "prefixes": [0.3, p1, 0.7, p2], "split": "70,30"}
    mixed = prepare(blend, seq_length=SEQ, cache_dir=tmp_path / "c", seed=3, train_samples=50,
                    val_samples=5, tokenizer_path=str(hf_dir))
    assert len(mixed.train_ds) >= 50 and mixed.train_ds[0]["tokens"].shape == (SEQ,)
    separate = dict(cfg, prefixes=[p1], valid_prefixes=[p2])
    sep = prepare(separate, seq_length=SEQ, cache_dir=tmp_path / "c", seed=3, train_samples=50, val_samples=5)
    assert len(sep.val_ds) >= 5


@pytest.mark.parametrize("cfg,kwargs,match", [
    ({"name": "nope"}, {}, "data.name"),
    ({"name": "indexed", "prefixes": ["/nonexistent/x"], "tokenizer": None}, {}, "data.tokenizer"),
    ({"name": "stdlib", "vocab_size": 100, "max_chars": 120_000}, {}, "data.vocab_size"),
    ({"name": "stdlib", "max_chars": 5}, {}, "data.max_chars"),
    ({"name": "stdlib"}, {"seq_length": 0}, "seq_length"),
    ({"name": "stdlib"}, {"train_samples": -3}, "train_samples"),
])
def test_prepare_bad_config(tmp_path, cfg, kwargs, match):
    args = dict(seq_length=SEQ, cache_dir=tmp_path, seed=1, train_samples=10, val_samples=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        prepare(cfg, **args)


def test_indexed_missing_prefix(tmp_path, small):
    small[0].tokenizer.save(tmp_path / "tok")
    cfg = {"name": "indexed", "prefixes": [str(tmp_path / "missing")], "tokenizer": str(tmp_path / "tok")}
    with pytest.raises(ValueError, match="data.prefixes.*missing"):
        prepare(cfg, seq_length=SEQ, cache_dir=tmp_path, seed=1, train_samples=10, val_samples=2)


def test_too_few_samples_is_an_error(tmp_path):
    cfg = {"name": "stdlib", "vocab_size": 512, "max_chars": 120_000}
    with pytest.raises(ValueError, match="data too small for trainer.seq_length=100000: the (training|validation) "
                                         "split holds"):
        prepare(cfg, seq_length=100_000, cache_dir=tmp_path, seed=1, train_samples=1, val_samples=None)


# -------------------------------------------------------------------------------------------------- cache

def test_cached_path_and_atomic_dir_race(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "root"))
    assert cache_dir() == (tmp_path / "root").resolve()
    a = cached_path("teacher", {"size": 1, "steps": 2})
    assert a == cached_path("teacher", {"steps": 2, "size": 1})  # key order does not matter
    assert a != cached_path("teacher", {"size": 1, "steps": 3}) and a.parent.name == "teacher"
    # Two builders race: both build, the first rename wins, the loser's copy is discarded.
    with atomic_dir(a) as first:
        with atomic_dir(a) as second:
            (second / "who").write_text("second")
        (first / "who").write_text("first")
    assert (a / "who").read_text() == "second"
    assert [p.name for p in a.parent.iterdir()] == [a.name]  # no temporary directory left behind
    # A failed build leaves nothing.
    b = cached_path("teacher", {"size": 9})
    with pytest.raises(RuntimeError):
        with atomic_dir(b) as tmp:
            (tmp / "partial").write_text("x")
            raise RuntimeError("boom")
    assert not b.exists() and [p.name for p in a.parent.iterdir()] == [a.name]
    calls = []
    assert build_cached(b, lambda tmp: calls.append((tmp / "f").write_text("ok"))) == b
    assert build_cached(b, lambda tmp: calls.append(1)) == b and len(calls) == 1
    with pytest.raises(ValueError, match="kind"):
        cached_path("../up", {})


# ---------------------------------------------------------------------------------------- two processes

def _worker(rank, world, port, root, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import kdexp.data.dataset as dm
    import kdexp.data.sources as sm

    calls = []
    real = sm.train_bpe
    sm.train_bpe = lambda *a, **k: calls.append(1) or real(*a, **k)
    cfg = DataConfig(**dict(SMALL, max_chars=150_000))
    bundle = dm.prepare(cfg, seq_length=SEQ, cache_dir=root, seed=5, train_samples=40, val_samples=4)
    mine = [b["tokens"].tolist() for b in dm.batches(bundle.train_ds, micro_batch_size=2, dp_rank=rank,
                                                     dp_size=world)][:5]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": len(calls), "sha": bundle.tokenizer.sha256, "batches": mine,
                   "first": bundle.train_ds[0]["tokens"].tolist()}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_build_once_and_split_batches(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path / "cache"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["calls"], r1["calls"]) == (1, 0)  # local rank 0 trained, rank 1 waited and read the cache
    assert r0["sha"] == r1["sha"] and r0["first"] == r1["first"]
    s0 = {tuple(row) for b in r0["batches"] for row in b}
    s1 = {tuple(row) for b in r1["batches"] for row in b}
    assert len(s0) == len(s1) == 10 and not s0 & s1


def test_preprocess_cli_matches_direct_tokenization(tmp_path, small):
    from kdexp.data.preprocess import main

    tok = small[0].tokenizer
    tok.save(tmp_path / "tok")
    texts = ["def f(x):\n    return x + 1\n", "Ünïcode prose.\n\nTwo paragraphs.", "", "print('hi')"]
    with open(tmp_path / "a.jsonl", "w") as f:
        for t in texts[:3]:
            f.write(json.dumps({"text": t}) + "\n")
    (tmp_path / "b.txt").write_text(texts[3])
    prefix = tmp_path / "out" / "corpus"
    assert main(["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--tokenizer",
                 str(tmp_path / "tok"), "--output-prefix", str(prefix)]) == 0
    ds = read_indexed(prefix)
    expected = [tok.encode(t) + [tok.eod] for t in texts if t]  # the empty document is skipped
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["corpus.bin", "corpus.idx", "corpus.kdexp.json"]
    record = json.loads((prefix.parent / "corpus.kdexp.json").read_text())
    assert record["max_token_id"] == max(max(ids) for ids in expected) and record["documents"] == 3
    assert record["tokens"] == sum(map(len, expected))
    assert record["tokenizer"] == {"id": tokens.tokenizer_id(tmp_path / "tok"), "directory": str(tmp_path / "tok"),
                                   "vocab_size": tok.vocab_size, "eod": tok.eod}
    with pytest.raises(ValueError, match="body"):
        main(["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--output-prefix",
              str(tmp_path / "x"), "--json-key", "body"])
    assert not list(tmp_path.glob(".x.tmp-*"))
