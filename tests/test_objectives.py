"""kdexp.objective's per-token functions (kdexp.objective.tokens) and the objective built from them on tiny tensors against float64 hand computations: the masked LM cross-entropy, the KD loss
and its logged stats (kept mass, ghost mass, nucleus size), val/kl_to_teacher and val/top1_agreement.

The KD loss is compared with tests/_kd_reference.py (an independent float64 reference written from the definition).
Loss options are given through kdexp.config.LossConfig's stable fields (top_k, top_p, min_k, temperature, ghost_token).
"""
from __future__ import annotations


import pytest
import torch

from _lone_process import lone_process as _lone_process
from _objective import kd_loss
from _kd_reference import reference_kd
from kdexp.config import LossConfig
from kdexp import objective
from kdexp.train.batches import batch_to

B, S, V = 2, 3, 11


@pytest.fixture(scope="module", autouse=True)
def lone_process():
    with _lone_process(seed=1):
        yield


def tiny(seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    student = teacher + torch.randn(B, S, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])  # two padded tokens
    return student.float(), teacher.float(), labels, mask


def masked_mean64(values, mask):
    values, mask = values.detach().double().reshape(-1), mask.double().reshape(-1)
    return float((values * mask).sum() / mask.sum())


def test_masked_mean_ignores_masked_tokens_and_an_empty_mask_is_zero():
    assert objective.masked_mean(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])).item() == 2.0
    assert objective.masked_mean(torch.tensor([1.0, 5.0]), torch.zeros(2)).item() == 0.0  # not 0/0


def test_lm_loss_is_the_masked_mean_cross_entropy_and_leaves_the_logits_intact():
    s, _, labels, mask = tiny()
    before = s.clone()
    got = objective.lm_loss(s, labels, mask)
    logp = torch.log_softmax(s.double(), -1)
    nll = -logp.gather(-1, labels[..., None])[..., 0]
    assert got.item() == pytest.approx(masked_mean64(nll, mask), rel=1e-6)
    assert torch.equal(s, before)  # megatron's cross-entropy works in place: the KD loss must still see these


def test_lm_loss_gradient_reaches_only_unmasked_tokens():
    s, _, labels, mask = tiny()
    s.requires_grad_(True)
    objective.lm_loss(s, labels, mask).backward()
    ref = s.detach().double().requires_grad_(True)
    nll = -torch.log_softmax(ref, -1).gather(-1, labels[..., None])[..., 0]
    ((nll * mask.double()).sum() / mask.sum()).backward()
    torch.testing.assert_close(s.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)
    assert s.grad[0, 2].abs().sum() == 0 and s.grad[1, 1].abs().sum() == 0


@pytest.mark.parametrize("options", [
    dict(name="topk", top_k=4, temperature=1.0),
    dict(name="topk", top_k=4, temperature=2.0, ghost_token=False),
    dict(name="top_p", top_k=None, top_p=0.7, min_k=2, temperature=1.5),
])
def test_kd_loss_and_its_stats_match_the_float64_reference(options):
    s, t, _, mask = tiny(1)
    cfg = LossConfig(**options)
    s = s.requires_grad_(True)
    loss, stats = kd_loss(s, t, mask, cfg)
    kw = {k: v for k, v in options.items() if k != "name"}
    ref_s = s.detach().double().reshape(-1, V).requires_grad_(True)
    ref, ref_stats = reference_kd(ref_s, t.double().reshape(-1, V), **kw)
    assert loss.item() == pytest.approx(masked_mean64(ref, mask), rel=1e-5, abs=1e-7)
    kept_t = torch.tensor(ref_stats["teacher_kept_mass"])
    kept_s = torch.tensor(ref_stats["student_kept_mass"])
    sizes = torch.tensor(ref_stats["nucleus_size"], dtype=torch.float64)
    assert stats.kept_mass.item() == pytest.approx(masked_mean64(kept_t, mask), rel=1e-5)
    # the logged ghost mass is the student's mass outside the kept set (what the ghost bucket asks it to shrink)
    assert stats.ghost_mass.item() == pytest.approx(masked_mean64(1 - kept_s, mask), rel=1e-5, abs=1e-7)
    assert stats.nucleus_size.item() == pytest.approx(masked_mean64(sizes, mask), rel=1e-6)
    if options.get("top_k"):
        assert stats.nucleus_size.item() == options["top_k"]
    loss.backward()
    ((ref * mask.double().reshape(-1)).sum() / mask.sum()).backward()
    torch.testing.assert_close(s.grad.double().reshape(-1, V), ref_s.grad, rtol=1e-4, atol=1e-7)


def test_kd_loss_is_zero_when_the_student_is_the_teacher():
    _, t, _, mask = tiny(2)
    loss, stats = kd_loss(t.clone(), t, mask, LossConfig(top_k=4))
    assert abs(loss.item()) < 1e-6
    assert stats.ghost_mass.item() == pytest.approx(1 - stats.kept_mass.item(), abs=1e-6)


def test_full_kl_is_the_full_vocabulary_forward_kl_at_t1():
    s, t, _, mask = tiny(3)
    p, logp, logq = torch.softmax(t.double(), -1), torch.log_softmax(t.double(), -1), torch.log_softmax(s.double(), -1)
    kl = (p * (logp - logq)).sum(-1)
    assert objective.full_kl(s, t, mask).item() == pytest.approx(masked_mean64(kl, mask), rel=1e-5)
    assert abs(objective.full_kl(t, t, mask).item()) < 1e-6


def test_top1_agreement_counts_unmasked_tokens_whose_argmax_matches_ties_to_the_smallest_index():
    t = torch.zeros(1, 4, 5)
    s = torch.zeros(1, 4, 5)
    t[0, 0, 2], s[0, 0, 2] = 3.0, 1.0  # agree
    t[0, 1, 4], s[0, 1, 0] = 3.0, 1.0  # disagree
    t[0, 2, 1], t[0, 2, 3], s[0, 2, 1] = 2.0, 2.0, 1.0  # teacher tie: index 1 wins, as does the student -> agree
    t[0, 3, 0], s[0, 3, 1] = 1.0, 1.0  # disagree, but masked out
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert objective.vocab_parallel_argmax(t).tolist() == [[2, 4, 1, 0]]
    assert objective.top1_agreement(s, t, mask).item() == pytest.approx(2 / 3)


def test_batch_to_keeps_the_fields_the_objectives_read():
    batch = {"tokens": torch.ones(1, 2, dtype=torch.long), "labels": torch.zeros(1, 2, dtype=torch.long),
             "loss_mask": torch.ones(1, 2), "position_ids": torch.arange(2)[None]}
    out = batch_to(batch, torch.device("cpu"))
    assert sorted(out) == ["labels", "loss_mask", "tokens"] and torch.equal(out["tokens"], batch["tokens"])
    batch["sample_index"] = torch.tensor([7])  # the teacher cache's key rides along, on the host
    assert torch.equal(batch_to(batch, torch.device("cpu"))["sample_index"], batch["sample_index"])
