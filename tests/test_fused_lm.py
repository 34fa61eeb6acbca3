"""The LM cross-entropy fused into the KD loss's pass over the vocabulary (`labels=`): the same values and the same
gradient as the KD loss plus a separate cross-entropy, for the online, cached and sampled losses, at TP=1 and TP=2,
and in the trainer's step (fused against unfused: the same parts and the same parameter gradients).

References: torch's cross_entropy in float64 (ignore_index for labels outside the vocabulary), the unfused loss
for the KD half, and megatron's vocab-parallel cross-entropy (kdexp.objective.lm_loss) in the step.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kdexp.losses import logits_kd_loss
from kdexp.losses.cached import cached_kd_loss, teacher_topk_record
from kdexp.losses.sampled import sampled_kd_loss

N, V = 29, 40
IGNORED = 5  # a token whose label is outside the vocabulary: no LM loss, no LM gradient

CASES = [dict(top_k=8), dict(top_k=8, top_p=0.6, min_k=2), dict(top_k=8, ghost_token=False),
         dict(top_k=8, normalization="renormalize", ghost_token=False), dict(top_k=V), dict(top_p=0.7),
         dict(top_k=8, divergence="reverse_kl"), dict(top_k=12, divergence="jsd", beta=0.3)]


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    s = t + torch.randn(N, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[IGNORED] = -100
    wk, wl = torch.rand(N, generator=g, dtype=torch.float64), torch.rand(N, generator=g, dtype=torch.float64)
    return s.to(dtype), t.to(dtype), labels, wk.to(dtype), wl.to(dtype)


def _ce64(s, labels):
    return F.cross_entropy(s.double(), labels, reduction="none", ignore_index=-100)


def _unfused(loss_fn, s0, labels, wk, wl):
    """The KD loss and a separate float64 cross-entropy: per-token values and the gradient of wk.kd + wl.lm."""
    s = s0.detach().clone().requires_grad_(True)
    kd = loss_fn(s)
    lm = _ce64(s, labels)
    ((kd * wk).sum().double() + (lm * wl.double()).sum()).backward()
    return kd.detach(), lm.detach(), s.grad


def _fused(loss_fn, s0, wk, wl):
    s = s0.detach().clone().requires_grad_(True)
    kd, lm = loss_fn(s)
    ((kd * wk).sum() + (lm * wl).sum()).backward()
    return kd.detach(), lm.detach(), s.grad


def _assert_same(fused, unfused, rtol, what):
    (kd, lm, g), (kd0, lm0, g0) = fused, unfused
    torch.testing.assert_close(kd, kd0, rtol=rtol, atol=rtol, msg=lambda m: f"{what} kd: {m}")
    torch.testing.assert_close(lm.double(), lm0, rtol=rtol, atol=rtol, msg=lambda m: f"{what} lm: {m}")
    torch.testing.assert_close(g.double(), g0.double(), rtol=rtol, atol=rtol * float(g0.abs().max()),
                               msg=lambda m: f"{what} grad: {m}")
    assert float(lm[IGNORED]) == 0.0


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_fused_lm_is_the_kd_loss_plus_a_cross_entropy(kw, dtype, rtol):
    s, t, labels, wk, wl = _data(dtype)
    fused = _fused(lambda x: logits_kd_loss(x, t, labels=labels, chunk_tokens=8, **kw), s, wk, wl)
    unfused = _unfused(lambda x: logits_kd_loss(x, t, chunk_tokens=8, **kw), s, labels, wk, wl)
    _assert_same(fused, unfused, rtol, kw)
    # the stats are those of the unfused call
    _, st = logits_kd_loss(s, t, labels=labels, return_stats=True, **kw)
    _, st0 = logits_kd_loss(s, t, return_stats=True, **kw)
    for a, b in zip(st, st0):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


def test_fused_lm_from_the_cache_and_from_draws():
    s, t, labels, wk, wl = _data()
    rec = teacher_topk_record(t, 16, [1.0])
    args = (rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0])
    for kw in (dict(top_k=16), dict(top_k=10, top_p=0.8)):
        fused = _fused(lambda x: cached_kd_loss(x, *args, labels=labels, **kw), s, wk, wl)
        unfused = _unfused(lambda x: logits_kd_loss(x, t, **kw), s, labels, wk, wl)
        _assert_same(fused, unfused, 2e-5, f"cached {kw}")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (N, 6), generator=g)
    w = torch.rand(N, 6, generator=g)
    w = w / w.sum(1, keepdim=True)
    logp = -torch.rand(N, 6, generator=g)
    fused = _fused(lambda x: sampled_kd_loss(x, ids, w, logp, labels=labels), s, wk, wl)
    unfused = _unfused(lambda x: sampled_kd_loss(x, ids, w, logp), s, labels, wk, wl)
    _assert_same(fused, unfused, 2e-5, "sampled")


def test_fused_lm_refuses_what_it_cannot_serve():
    s, t, labels, _, _ = _data()
    with pytest.raises(ValueError, match="Top-K / Top-P loss at temperature 1.0"):
        logits_kd_loss(s, t, labels=labels)  # dense
    with pytest.raises(ValueError, match="temperature=2.0"):
        logits_kd_loss(s, t, top_k=8, temperature=2.0, labels=labels)
    with pytest.raises(ValueError, match="leading shape"):
        logits_kd_loss(s, t, top_k=8, labels=labels[:-1])
    with pytest.raises(ValueError, match="temperature 1.0"):
        sampled_kd_loss(s, labels[:, None], torch.ones(N, 1), temperature=2.0, labels=labels)


def test_the_step_rule_fuses_sparse_and_sampled_losses_at_temperature_one():
    from kdexp.config import LossConfig
    from kdexp import objective

    def fuses_lm(c):  # the term the registry builds for an online teacher
        loss = objective.LossOptions.parse(c)
        return objective.LOSSES[(objective.family(loss), "online")](loss, None).fuses_lm

    assert fuses_lm(LossConfig(top_k=1024))
    assert fuses_lm(LossConfig(top_k=None, top_p=0.9))
    assert fuses_lm(LossConfig(top_k=None, ghost_token=False, samples=64))
    assert not fuses_lm(LossConfig(top_k=None))  # dense
    assert not fuses_lm(LossConfig(top_k=None, top_p=1.0))  # a nucleus that cuts nothing: dense
    assert not fuses_lm(LossConfig(top_k=1024, temperature=2.0))


# --------------------------------------------------------------------------------------------------------- TP=2

def _tp_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        s, t, labels, wk, wl = _data()
        for split in ((0, 20, 40), (0, 13, 40)):  # even shards, and an uneven split
            a, b = split[rank], split[rank + 1]
            for kw in CASES:
                ref = _unfused(lambda x: logits_kd_loss(x, t, **kw), s, labels, wk, wl)
                sh = s[:, a:b].clone().requires_grad_(True)
                kd, lm = logits_kd_loss(sh, t[:, a:b].contiguous(), labels=labels, tp_group=dist.group.WORLD,
                                        chunk_tokens=8, **kw)
                ((kd * wk).sum() + (lm * wl).sum()).backward()
                _assert_same((kd.detach(), lm.detach(), sh.grad), (ref[0], ref[1], ref[2][:, a:b]), 2e-5,
                             f"TP=2 {kw} split {split} rank {rank}")
            g = torch.Generator().manual_seed(3)
            ids = torch.randint(0, V, (N, 6), generator=g)
            w = torch.rand(N, 6, generator=g)
            ref = _unfused(lambda x: sampled_kd_loss(x, ids, w), s, labels, wk, wl)
            sh = s[:, a:b].clone().requires_grad_(True)
            kd, lm = sampled_kd_loss(sh, ids, w, labels=labels, tp_group=dist.group.WORLD)
            ((kd * wk).sum() + (lm * wl).sum()).backward()
            _assert_same((kd.detach(), lm.detach(), sh.grad), (ref[0], ref[1], ref[2][:, a:b]), 2e-5,
                         f"TP=2 sampled split {split} rank {rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fused_lm_under_tp2_is_each_ranks_slice():
    from kdexp.distributed.testing import free_port

    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2, join=True)


# ------------------------------------------------------------------------------------------------------ the step

@pytest.mark.parametrize("overrides", [(), ("loss=sampled",), ("balancer.alpha=1.0",), ("balancer=dynamic",)],
                         ids=lambda o: " ".join(o) or "default")
def test_the_trainers_step_fused_and_unfused_agree(overrides, monkeypatch):
    """train_step on the tiny shipped shapes with a random teacher: the fused LM loss gives the unfused step's
    logged parts (train/lm_loss from megatron's cross-entropy there) and its parameter gradients."""
    from hydra import compose, initialize_config_module

    import kdexp.config
    from _lone_process import lone_process
    from kdexp.bench import gpu_scale
    from kdexp.data import batches
    from kdexp.train import loop
    from kdexp.train.batches import batch_to
    from kdexp.train.step import train_step

    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["logger=none", "experiment=smoke", *overrides])
    kdexp.config.validate(cfg)
    with lone_process(seed=1) as st:
        s = loop.setup(cfg, make_teacher=gpu_scale.random_teacher)
        assert s.objective.fuses_lm
        batch = batch_to(next(iter(batches(s.data.train_ds, micro_batch_size=cfg.trainer.micro_batch_size,
                                                      dp_rank=0, dp_size=1))), st.device)
        runs = []
        for fuse in (True, False):
            s.objective.fuses_lm = fuse
            s.student.zero_grad(set_to_none=True)
            parts = train_step(s.student, s.objective, batch, s.balancer, cfg, s.balancer.needs_lm_loss, step=3)
            grads = {n: p.grad.detach().clone() for n, p in s.student.named_parameters() if p.grad is not None}
            runs.append(({k: float(v) for k, v in parts.items()}, grads))
    (fp, fg), (up, ug) = runs
    assert fp.keys() == up.keys()
    for k in fp:
        assert fp[k] == pytest.approx(up[k], rel=2e-5, abs=1e-6), k
    assert fg.keys() == ug.keys() and fg
    for n in fg:
        torch.testing.assert_close(fg[n], ug[n], rtol=1e-4, atol=1e-4 * float(ug[n].abs().max()) + 1e-9,
                                   msg=lambda m: f"{n}: {m}")
