"""The teacher cache's "sampled" record (sampled KD, RS-KD, from the cache) on the fake teacher of
tests/_teacher_cache_worker.py.

Exactness: for every global sample i, the fp32 cache holds the draws `sample_teacher` makes online from the same
teacher logits with seed draw_seed(data.seed, i) (ids and counts bit-equal), and the trainer's objective on the
cache gives the loss, student gradient and stats of `sampled_kd_loss` on those online draws within 1e-5 relative, at a
proposal temperature equal to and different from the loss temperature, weights normalised or not, at both cached
temperatures. A compact bf16 cache within a stated tolerance. The draws do not depend on the micro-batch size; the
config chooses the record; a cache of other draws (count, proposal temperature, seed) or of the other record type is a
CacheMismatch naming the entry. (Corruption, resume after SIGKILL and TP/DP builds are the shared machinery's tests in
tests/test_teacher_cache.py, run for both record types.)
"""
from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import _teacher_cache_worker as w
from _lone_process import lone_process
from kdexp.losses import KDLossOptions, SampledKDOptions, sample_teacher, sampled_kd_loss, weigh
from kdexp.losses.sampled import TokenSamples, unique_mass
from kdexp.teacher import CacheMismatch, TeacherCache
from kdexp.teacher import format as fmt

DRAWS = 16  # over the fake teacher's 300 ids: some ids drawn twice or more, some slots unused
PROPOSALS = (1.0, 2.0)  # each equal to one cached temperature (w.TEMPS) and different from the other
SAMPLES = [7, 0, 9, 3]  # across shards, the short last one included


def _build(path, values="float32", proposal=1.0, micro_batch_size=2, **layout):
    from kdexp.teacher.writer import ensure_at

    lay = w.layout(values, **{"draws": DRAWS, "proposal_temperature": proposal, **layout})
    with lone_process(seed=0):
        return ensure_at(path, w.key(lay), lay, w.FakeTeacher(), w.dataset(), micro_batch_size)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled_caches")
    return {(v, q): _build(root / f"{v}-{q}", v, q) for v in ("float32", "bfloat16") for q in PROPOSALS}


def _online(samples, proposal, temperature, normalize) -> TokenSamples:
    """sample_teacher on each sample's teacher logits with its cache seed, stacked: what an online draw gives."""
    ds, teacher = w.dataset(), w.FakeTeacher()
    per_sample = []
    for i in samples:
        logits = teacher(ds[i]["tokens"][None], torch.arange(w.SEQ)[None], None)[0]
        per_sample.append(sample_teacher(logits, samples=DRAWS, proposal_temperature=proposal,
                                         temperature=temperature, seed=fmt.draw_seed(w.DRAW_SEED, i),
                                         normalize=normalize))
    return TokenSamples(*(torch.stack(part) for part in zip(*per_sample)))


def _loss_cfg(temperature, proposal, normalize) -> dict:
    return {**asdict(KDLossOptions(temperature=temperature, ghost_token=False)),
            **asdict(SampledKDOptions(samples=DRAWS, proposal_temperature=proposal, normalize_weights=normalize))}


def _student_and_mask():
    g = torch.Generator().manual_seed(3)
    student = torch.randn(len(SAMPLES), w.SEQ, w.VOCAB, generator=g) * 2
    mask = (torch.rand(len(SAMPLES), w.SEQ, generator=g) > 0.25).float()
    return student, mask


def _cached_vs_online(cache, proposal, temperature, normalize):
    """(cached objective: loss, stats, grad), (online reference: loss, stats, grad), the online draws."""
    from _objective import kd_loss

    student, mask = _student_and_mask()
    a = student.clone().requires_grad_(True)
    with lone_process(seed=0):
        kd, stats = kd_loss(a, cache, mask, _loss_cfg(temperature, proposal, normalize),
                            sample_index=torch.tensor(SAMPLES))
    kd.backward()
    online = _online(SAMPLES, proposal, temperature, normalize)
    b = student.clone().requires_grad_(True)
    per_token = sampled_kd_loss(b, online.ids, online.weights, online.teacher_logprobs, temperature=temperature)
    ref = (per_token * mask).sum() / mask.sum()
    ref.backward()
    mass, distinct = unique_mass(online)
    ref_stats = {"kept_mass": (mass * mask).sum() / mask.sum(), "nucleus_size": (distinct * mask).sum() / mask.sum()}
    return (kd.detach(), stats, a.grad), (ref.detach(), ref_stats, b.grad), online


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "plain"])
@pytest.mark.parametrize("temperature", w.TEMPS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("proposal", PROPOSALS, ids=lambda t: f"Tq{t}")
def test_fp32_cache_equals_online_sampled_kd(caches, proposal, temperature, normalize):
    cache = caches[("float32", proposal)]
    (kd, stats, grad), (ref, ref_stats, ref_grad), online = _cached_vs_online(cache, proposal, temperature, normalize)
    # the stored draws are sample_teacher's, and weigh rebuilds its weights and log-probs from them
    got = weigh(cache.read(SAMPLES, temperature), temperature=temperature, proposal_temperature=proposal,
                normalize=normalize)
    assert torch.equal(got.ids, online.ids) and torch.equal(got.counts, online.counts)
    assert (online.counts > 1).any() and (online.counts == 0).any()  # repeats compacted, unused slots kept
    torch.testing.assert_close(got.weights, online.weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.teacher_logprobs, online.teacher_logprobs, rtol=1e-5, atol=1e-6)
    # the trainer's objective on the cache vs sampled_kd_loss on the online draws
    assert kd.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5 * ref_grad.abs().max().item())
    for name, value in ref_stats.items():
        assert getattr(stats, name).item() == pytest.approx(value.item(), rel=1e-5), name


# bf16 values round each drawn id's centred logit to 8 significant bits (relative error <= 2^-9): log p of an id at
# |centred| / T ~ 10 moves by up to ~0.02. The weights at proposal == temperature are c / samples whatever the values,
# so the gradient stays exact there; the loss value (sum w log p) and, at another proposal, the weights p / q move.
# Measured on these caches: loss <= 5.4e-4 relative, gradient (at another proposal) <= 6e-3 of its largest entry.
BF16_LOSS_REL, BF16_GRAD_REL = 2e-3, 2e-2


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "plain"])
@pytest.mark.parametrize("temperature", w.TEMPS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("proposal", PROPOSALS, ids=lambda t: f"Tq{t}")
def test_bf16_cache_within_its_tolerance(caches, proposal, temperature, normalize):
    cache = caches[("bfloat16", proposal)]
    (kd, _, grad), (ref, _, ref_grad), _ = _cached_vs_online(cache, proposal, temperature, normalize)
    assert kd.item() == pytest.approx(ref.item(), rel=BF16_LOSS_REL)
    scale = ref_grad.abs().max().item()
    rel = 1e-5 if proposal == temperature else BF16_GRAD_REL
    torch.testing.assert_close(grad, ref_grad, rtol=rel, atol=rel * scale)
    files = [p for p in cache.path.iterdir() if p.suffix[1:] in fmt.RECORD_PARTS["sampled"]]
    assert sum(p.stat().st_size for p in files) == w.SAMPLES * w.SEQ * cache.layout.bytes_per_token()
    assert cache.layout.bytes_per_token() == DRAWS * (2 + 2 + 1) + 4 * 3


def test_draws_do_not_depend_on_the_micro_batch_size(caches, tmp_path):
    """Each global sample draws from its own seeded stream, so the shard bytes are those of any batching."""
    other = _build(tmp_path / "c", micro_batch_size=3)
    for part in fmt.RECORD_PARTS["sampled"]:
        for j in range(other.layout.shards):
            name = fmt.shard_file(other.path, j, part).name
            assert (other.path / name).read_bytes() == (caches[("float32", 1.0)].path / name).read_bytes(), name


def test_another_sampled_key_is_refused_naming_it(caches, tmp_path):
    path = caches[("float32", 1.0)].path
    for changes, says in ((dict(draws=32), r"loss.samples: cache 16, this run 32"),
                          (dict(proposal_temperature=1.5), r"loss.proposal_temperature: cache 1.0, this run 1.5"),
                          (dict(draw_seed=7), r"draw_seed: cache 1234, this run 7")):
        lay = w.layout(**{"draws": DRAWS, "proposal_temperature": 1.0, **changes})
        with pytest.raises(CacheMismatch, match=says):
            TeacherCache(path, w.key(lay))
    with pytest.raises(CacheMismatch, match=r"k_max: cache '<absent>', this run 12; .*record: cache 'sampled', "
                                            r"this run 'topk'"):
        TeacherCache(path, w.key(w.layout()))  # a top-K run pointed at a sampled cache
    with pytest.raises(CacheMismatch, match=r"loss.samples: cache 16, this run 32"):  # the build path refuses it too
        _build(path, draws=32)


def test_the_config_chooses_the_record():
    """teacher=cached + loss.samples: a sampled layout keyed by the draws (teacher.k_max plays no part); else top-K.
    Bytes per token at the embedded default's vocabulary (2,048: 2-byte ids), one temperature."""
    from test_teacher_cache_run import cfg_of

    from kdexp.teacher import writer

    data = SimpleNamespace(vocab_size=2048, fingerprint="data", train_ds=range(100), windows=lambda n: min(n, 100))
    with lone_process(seed=0):
        topk = writer.layout_for(cfg_of("teacher=cached"), data)
        cfg = cfg_of("teacher=cached", "loss=sampled", "loss.proposal_temperature=1.5", "data.seed=7",
                     "teacher.k_max=5")
        sampled = writer.layout_for(cfg, data)
        key = writer.cache_key(cfg, data, sampled, "fake")
        topk_key = writer.cache_key(cfg_of("teacher=cached"), data, topk, "fake")
    assert (topk.record, topk.k_max, topk.bytes_per_token()) == ("topk", 1024, 6152)
    assert (sampled.record, sampled.draws, sampled.proposal_temperature, sampled.draw_seed) == ("sampled", 64, 1.5, 7)
    assert sampled.bytes_per_token() == 456  # 64 x (4 + 2 + 1) + 2 x 4: 13x below top-1024's 6,152
    assert key["record"] == "sampled" and key["loss.samples"] == 64 and key["loss.proposal_temperature"] == 1.5
    assert key["draw_seed"] == key["data.seed"] == 7 and "k_max" not in key  # the draws are data.seed's
    assert topk_key["record"] == "topk" and topk_key["k_max"] == 1024 and "loss.samples" not in topk_key
    assert fmt.Layout.from_json(sampled.to_json()) == sampled and "draws" not in topk.to_json()
