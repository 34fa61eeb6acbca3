"""Generation (kdexp.models.generation) and its vocabulary-sharded sampler (kdexp.models.sampling).

References: the KV cache against recomputing the whole prefix at every step (same seeds: same tokens, log-probs to
1e-5); the sampler's log-probs against a float64 softmax / nucleus of the full logits of the finished sequences; the
top-p set against a sort-and-cumsum nucleus (ties kept whole); draw frequencies against the distribution; TP 2 (two
gloo processes) against TP 1, for the model and for the bare sampler on one logits tensor split in two shards.
Tiny random models (the tiny-student shape: GQA 4 query over 2 kv heads, q/k norms), a few tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process
from kdexp.distributed.testing import run_on_processes
from kdexp.models import build, forward_logits, get_spec, mask_padded_vocab
from kdexp.models.generation import generate, rollout_seeds
from kdexp.models.sampling import nucleus_threshold, order_codes, sample_shard

V, P, N = 256, 5, 6
GEN = dict(max_new_tokens=N, temperature=0.8, top_p=0.9)


@pytest.fixture
def tp1(monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch) as state:
        yield state


def _model(attention="sdpa", tie=True, seed=7):
    kd.reseed(seed)
    return build(get_spec("tiny-student", vocab_size=V, max_position_embeddings=64, tie_embeddings=tie),
                 attention=attention)


def _prompts(b=3, seed=1):
    return torch.randint(0, V, (b, P), generator=torch.Generator().manual_seed(seed))


def _reference_nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """float64 [.., V] -> bool nucleus: the smallest prefix by descending probability with mass >= top_p, ties with
    its last member kept."""
    p = torch.softmax(z, -1)
    srt, order = p.sort(-1, descending=True)
    before = srt.cumsum(-1) - srt  # mass strictly above each sorted token
    last = (before < top_p).sum(-1, keepdim=True) - 1  # the sorted index that reaches top_p
    cut = srt.gather(-1, last)
    return p >= cut


@pytest.mark.parametrize("attention,tie", [("sdpa", True), ("sdpa", False), ("megatron", True), ("megatron", False)])
def test_kv_cache_gives_the_recomputed_tokens(tp1, attention, tie):
    model = _model(attention, tie)
    seeds = rollout_seeds(3, 0, range(3))
    cached = generate(model, _prompts(), seeds=seeds, **GEN)
    full = generate(model, _prompts(), seeds=seeds, kv_cache=False, **GEN)
    assert torch.equal(cached.tokens, full.tokens)
    assert torch.equal(cached.generated, full.generated)
    torch.testing.assert_close(cached.sampler_logprobs, full.sampler_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(cached.tokens[:, :P], _prompts())
    assert model.training  # the train/eval mode is restored


def test_sampler_logprobs_match_a_float64_reference(tp1):
    model = _model()
    temperature, top_p = 0.7, 0.8
    r = generate(model, _prompts(), seeds=rollout_seeds(4, 1, range(3)), max_new_tokens=N, temperature=temperature,
                 top_p=top_p)
    with torch.no_grad():
        z = forward_logits(model, r.tokens).double()[:, P - 1:-1] / temperature  # predicts each generated position
    keep = _reference_nucleus(z, top_p)
    logq = torch.where(keep, z, -math.inf).log_softmax(-1)
    new = r.tokens[:, P:]
    assert keep.gather(-1, new[..., None]).all()  # every draw lies in the nucleus
    torch.testing.assert_close(r.sampler_logprobs, logq.gather(-1, new[..., None])[..., 0], rtol=0, atol=1e-5)
    assert bool((keep.sum(-1) < V).all())  # the cut removed something: the test tells top_p from no top_p


def test_tiny_temperature_is_greedy(tp1):
    model = _model()
    r = generate(model, _prompts(), seeds=rollout_seeds(5, 0, range(3)), max_new_tokens=N, temperature=1e-6)
    tokens = _prompts()
    with torch.no_grad():
        for _ in range(N):
            tokens = torch.cat([tokens, forward_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(r.tokens, tokens)
    assert r.sampler_logprobs.abs().max() < 1e-6  # a point mass


def test_eos_stops_a_row_and_pads_it(tp1):
    model = _model()
    seeds = rollout_seeds(6, 0, range(3))
    free = generate(model, _prompts(), seeds=seeds, **GEN)
    eos = int(free.tokens[0, P + 2])
    r = generate(model, _prompts(), seeds=seeds, eos_id=eos, **GEN)
    for i in range(3):
        gen = free.tokens[i, P:].tolist()
        n = gen.index(eos) + 1 if eos in gen else N
        assert int(r.lengths[i]) == n and bool(r.truncated[i]) == (eos not in gen)
        assert r.tokens[i, P:P + n].tolist() == gen[:n]  # the same draws up to the stop, the eos kept
        assert (r.tokens[i, P + n:] == eos).all()  # then padding
        assert r.generated[i].tolist() == [False] * P + [True] * n + [False] * (N - n)
        assert (r.sampler_logprobs[i, n:] == 0).all()
        torch.testing.assert_close(r.sampler_logprobs[i, :n], free.sampler_logprobs[i, :n], rtol=0, atol=1e-6)
    assert int(r.lengths[0]) <= 3 and not bool(r.truncated[0])


def test_a_samples_tokens_do_not_depend_on_its_batch(tp1):
    model = _model()
    prompts, seeds = _prompts(4), rollout_seeds(8, 2, range(10, 14))
    batch = generate(model, prompts, seeds=seeds, **GEN)
    alone = generate(model, prompts[2:3], seeds=seeds[2:3], **GEN)
    order = [3, 1, 0, 2]
    shuffled = generate(model, prompts[order], seeds=seeds[order], **GEN)
    assert torch.equal(alone.tokens[0], batch.tokens[2])
    assert torch.equal(shuffled.tokens, batch.tokens[order])


def test_bf16_model_and_its_float16module_wrapper_generate_alike(tp1):
    """megatron's Float16Module hands back fp32 hidden states of a bf16 model: the head casts them back, so the
    wrapped model draws what the bare one draws."""
    from megatron.core.transformer.module import Float16Module

    kd.reseed(7)
    model = build(get_spec("tiny-student", vocab_size=V, max_position_embeddings=64), params_dtype=torch.bfloat16)
    seeds = rollout_seeds(2, 0, range(3))
    bare = generate(model, _prompts(), seeds=seeds, **GEN)
    wrapped = generate(Float16Module(model.config, model), _prompts(), seeds=seeds, **GEN)
    assert torch.equal(bare.tokens, wrapped.tokens)
    torch.testing.assert_close(bare.sampler_logprobs, wrapped.sampler_logprobs, rtol=0, atol=0)


def test_top_p_set_matches_a_sorted_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    logits[1, :10] = logits[1, 10]  # ties straddling the cut are kept whole
    logits[2] = torch.round(logits[2] * 2) / 2
    logits[3, 40:] = -math.inf  # masked ids
    for top_p in (0.05, 0.5, 0.9, 0.999):
        z = logits.double()
        tau = nucleus_threshold(order_codes(logits), torch.softmax(z, -1), top_p)
        assert torch.equal(order_codes(logits) >= tau[:, None], _reference_nucleus(z, top_p)), top_p


def test_draws_follow_the_sampled_distribution():
    """40,000 draws of one 6-id row (different seeds) land with the frequencies of q (4.5 sigma per id)."""
    n = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, -1)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8)):
        ids, lq = sample_shard(logits, vocab_start=0, temperature=temperature, top_p=top_p,
                               seeds=torch.arange(n), positions=torch.full((n,), 9))
        z = logits[0].double() / temperature
        q = torch.where(_reference_nucleus(z, top_p), z, -math.inf).softmax(-1)
        freq = torch.bincount(ids, minlength=6).double() / n
        assert ((freq - q).abs() <= 4.5 * (q * (1 - q) / n).sqrt() + 1e-12).all(), (freq, q)
        torch.testing.assert_close(lq, q.log()[ids], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=0.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(eos_id=V), "eos_id"),
    (dict(seeds=torch.arange(2)), "seeds"), (dict(max_new_tokens=100), "max_position_embeddings")])
def test_bad_arguments_name_themselves(tp1, bad, match):
    model = _model()
    kw = dict(max_new_tokens=2, seeds=torch.arange(3)) | bad
    with pytest.raises(ValueError, match=match):
        generate(model, _prompts(), **kw)


def _runs(top_ps=(0.9,)):
    """Rollouts of each model variant, and the bare sampler on one fixed logits tensor (this rank's shard)."""
    out = {}
    for attention, tie in (("sdpa", True), ("megatron", False)):
        model = _model(attention, tie)
        out[attention, tie] = generate(model, _prompts(), seeds=rollout_seeds(9, 0, range(3)), **GEN)
    model = mask_padded_vocab(_model(), real_vocab=200)  # rank 1 of TP 2 holds ids 128..255: 200.. are padding
    out["padded"] = generate(model, _prompts(), seeds=rollout_seeds(9, 1, range(3)), max_new_tokens=N,
                             temperature=3.0)
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(2))
    logits[:8] = torch.round(logits[:8])  # ties across the shards
    shard = logits.chunk(tp, -1)[rank]
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    for top_p in (1.0, 0.3, 0.9):
        out["sampler", top_p] = sample_shard(shard, vocab_start=rank * shard.shape[-1], temperature=0.9, top_p=top_p,
                                             seeds=torch.arange(64) * 7, positions=torch.arange(64), group=group)
    return out


def _tp2_worker(rank, world_size):
    kd.initialize(tensor_parallel=2, seed=5)
    return _runs()


def test_tp2_gives_tp1s_tokens(tp1):
    ref = _runs()
    ranks = run_on_processes(_tp2_worker, 2)
    for got in ranks:
        for key, want in ref.items():
            if key[0] == "sampler":
                assert torch.equal(got[key][0], want[0]), key
                torch.testing.assert_close(got[key][1], want[1], rtol=0, atol=1e-12)
                continue
            assert torch.equal(got[key].tokens, want.tokens), key
            assert torch.equal(got[key].generated, want.generated), key
            torch.testing.assert_close(got[key].sampler_logprobs, want.sampler_logprobs, rtol=0, atol=1e-5)
    assert int(ref["padded"].tokens[:, P:].max()) < 200  # no padded id is ever drawn
