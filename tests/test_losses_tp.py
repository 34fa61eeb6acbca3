"""logits_kd_loss under tensor parallelism: TP=2 (2 gloo processes) against TP=1, losses AND gradients.

Each rank holds its contiguous vocabulary shard (rank order, as Megatron's vocab-parallel output layer gives it).
The per-token loss must equal the unsharded value on every rank and each rank's gradient must be exactly its slice
of the unsharded gradient (no factor of the TP size). The float64 reference checks the unsharded run too.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdexp.distributed.testing import free_port

V, N = 64, 6

CASES = [
    dict(),
    dict(divergence="reverse_kl", temperature=1.5),
    dict(divergence="jsd", beta=0.3),
    dict(top_k=7),
    dict(top_k=40, ghost_token=False),  # top_k > one shard's vocabulary
    dict(top_k=9, top_p=0.6, min_k=2, divergence="reverse_kl"),
    dict(top_p=0.8, min_k=2, temperature=0.9),
    dict(top_k=6, normalization="renormalize", ghost_token=False, divergence="jsd"),
    dict(top_k=V),
]


def _check_case(kw, s, t, w, lo, hi, rank):
    from _kd_reference import reference_kd
    from kdexp.losses import logits_kd_loss

    full = s.clone().requires_grad_(True)
    ref_loss, ref_stats = logits_kd_loss(full, t, return_stats=True, **kw)  # TP=1, unsharded
    (ref_loss * w).sum().backward()

    shard = s[:, lo:hi].clone().requires_grad_(True)
    loss, stats = logits_kd_loss(shard, t[:, lo:hi].contiguous(), tp_group=dist.group.WORLD, return_stats=True,
                                 chunk_tokens=4, **kw)
    (loss * w).sum().backward()
    where = f"{kw} split {lo}:{hi} rank {rank}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
    torch.testing.assert_close(shard.grad, full.grad[:, lo:hi], rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{where} grad: {m}")
    for a, b in zip(stats, ref_stats):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} stats: {m}")

    ref64 = s.double().requires_grad_(True)
    r64, _ = reference_kd(ref64, t, **kw)
    (r64 * w.double()).sum().backward()
    torch.testing.assert_close(loss.double(), r64.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    torch.testing.assert_close(shard.grad.double(), ref64.grad[:, lo:hi], rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{where}: {m}")


NEAR_CASES = [  # near convergence at logit offset 256: centring must use the max over all ranks
    dict(), dict(temperature=2.0), dict(temperature=3.0, divergence="reverse_kl"), dict(top_k=8),
    dict(top_k=40, ghost_token=False, temperature=0.5), dict(top_p=0.7, min_k=2, divergence="jsd"),
    dict(top_k=8, normalization="renormalize", ghost_token=False, temperature=4.0),
]


def _check_near(kw, s, t, lo, hi, rank):
    """TP=2 against float64 (and so against TP=1, which tests/test_losses.py holds to the same standard)."""
    from _kd_reference import reference_kd
    from kdexp.losses import logits_kd_loss

    shard = s[:, lo:hi].clone().requires_grad_(True)
    loss = logits_kd_loss(shard, t[:, lo:hi].contiguous(), tp_group=dist.group.WORLD, chunk_tokens=4, **kw)
    loss.sum().backward()
    ref64 = s.double().requires_grad_(True)
    r64, _ = reference_kd(ref64, t, **kw)
    r64.sum().backward()
    where = f"near-converged {kw} split {lo}:{hi} rank {rank}"
    err = float((loss.detach().double() - r64.detach()).abs().max())
    assert err <= 1e-6 and float(loss.min()) >= -1e-7, f"{where}: loss error {err:.2e}, min {float(loss.min()):.2e}"
    scale = float(ref64.grad.abs().max())
    gerr = float((shard.grad.double() - ref64.grad[:, lo:hi]).abs().max())
    assert gerr <= 4e-3 * scale, f"{where}: gradient error {gerr:.2e} vs scale {scale:.2e}"


def _worker(rank, world, port, splits):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import kdexp.losses._sparse as sparse_mod

        sparse_mod.TOP_P_INITIAL_K = 4  # exercise the growing Top-P search (identically on both ranks)
        g = torch.Generator().manual_seed(0)
        t = torch.randn(N, V, generator=g) * 1.5
        s = t + torch.randn(N, V, generator=g)
        w = torch.linspace(0.5, 1.5, N)
        for split in splits:
            for kw in CASES:
                _check_case(kw, s, t, w, split[rank], split[rank + 1], rank)
        t = (torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0 + 256.0).float()
        s = (t.double() + torch.randn(N, V, generator=g, dtype=torch.float64) * 1e-3).float()
        for split in splits:
            for kw in NEAR_CASES:
                _check_near(kw, s, t, split[rank], split[rank + 1], rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_matches_tp1():
    # Even shards (Megatron's layout) and an uneven split (offsets come from the gathered shard sizes).
    mp.spawn(_worker, args=(2, free_port(), [(0, 32, 64), (0, 27, 64)]), nprocs=2, join=True)
