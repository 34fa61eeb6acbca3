"""kdexp.distributed: process groups, megatron parallel state and the CPU answers to megatron's CUDA assumptions.

The TP=2 run (two gloo processes) is checked against an independent TP=1 run of the same tiny megatron GPTModel.
"""

import dataclasses
import os
import sys

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process as _lone_process
from kdexp.distributed import cpu
from kdexp.distributed.launch import Launch
from kdexp.distributed.testing import run_on_processes

VOCAB, SEQ, BATCH = 128, 16, 2


@pytest.fixture
def lone_process(monkeypatch):
    with _lone_process(monkeypatch=monkeypatch):
        yield


def _tiny_gpt(tp):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, layernorm_epsilon=1e-6, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    rotary_base=1000000, share_embeddings_and_output_weights=False)


def _fwd_bwd(rank, world_size, tp):
    """One forward+backward of a tiny GPTModel; returns the loss and full (TP-gathered) tensors to compare."""
    from megatron.core import tensor_parallel

    st = kd.initialize(tensor_parallel=tp, seed=7)
    assert (st.world_size, st.tp_size, st.tp_rank, st.dp_size, st.backend) == (world_size, tp, rank, 1, "gloo")
    model = _tiny_gpt(tp)
    gen = torch.Generator().manual_seed(0)  # same data on every rank and in both runs
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    logits = model(inputs, pos, mask)  # [b, s, V/tp]
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous().float(), labels.transpose(0, 1).contiguous()).mean()
    loss.backward()

    def gather(t, dim=0):
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=kd.tp_group())
        return torch.cat(parts, dim=dim)

    fc2 = model.decoder.layers[0].mlp.linear_fc2
    return {
        "loss": loss.detach(),
        "logits": gather(logits.detach(), dim=-1),
        "final_norm_grad": model.decoder.final_layernorm.weight.grad.clone(),
        "fc2_grad": gather(fc2.weight.grad, dim=1),  # row-parallel: sharded along the input dim
        "qkv_weight": gather(model.decoder.layers[0].self_attention.linear_qkv.weight.detach()),
    }


@pytest.mark.slow
def test_tp2_matches_tp1(lone_process):
    ref = _fwd_bwd(0, 1, 1)  # the TP=1 reference, in this process
    kd.destroy()
    r0, r1 = run_on_processes(_fwd_bwd, 2, args=(2,))
    # Same initial weights (megatron's CPU init builds the master weight and slices it) ...
    torch.testing.assert_close(r0["qkv_weight"], ref["qkv_weight"], rtol=0, atol=0)
    for r in (r0, r1):
        torch.testing.assert_close(r["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["final_norm_grad"], ref["final_norm_grad"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(r["fc2_grad"], ref["fc2_grad"], rtol=1e-4, atol=1e-6)
    assert ref["final_norm_grad"].abs().sum() > 0


def test_single_process_initialize_is_idempotent(lone_process):
    from megatron.core import parallel_state as ps

    st = kd.initialize(seed=3)
    assert (st.rank, st.world_size, st.tp_size, st.tp_rank, st.dp_size, st.dp_rank) == (0, 1, 1, 0, 1, 0)
    assert st.source == "local" and st.device == torch.device("cpu") and st.backend == "gloo"
    assert ps.model_parallel_is_initialized() and kd.is_rank0()
    assert kd.initialize(seed=3) is st and kd.state() is st
    assert torch.distributed.get_world_size(kd.tp_group()) == 1
    assert torch.distributed.get_world_size(kd.dp_group()) == 1
    with pytest.raises(ValueError, match="parallel.tensor"):
        kd.initialize(tensor_parallel=2)
    kd.destroy()
    assert not kd.is_initialized() and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError):
        kd.state()


def test_tp_must_divide_world_size(lone_process):
    with pytest.raises(ValueError, match=r"parallel\.tensor=2"):
        kd.initialize(tensor_parallel=2)
    with pytest.raises(ValueError, match="parallel.tensor"):
        kd.initialize(tensor_parallel=0)


def test_cpu_rng_tracker_forks_deterministically(lone_process):
    from megatron.core import tensor_parallel

    kd.initialize(seed=11)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, tensor_parallel.random.CudaRNGStatesTracker)

    def draw():
        cpu.model_parallel_manual_seed(11, tp_rank=0)
        a = torch.rand(4)
        with tracker.fork():
            forked = torch.rand(4)
        b = torch.rand(4)
        return a, forked, b

    a, forked, b = draw()
    a2, forked2, b2 = draw()
    torch.testing.assert_close((a, forked, b), (a2, forked2, b2), rtol=0, atol=0)
    # The default stream continues as if the fork had not happened ...
    torch.manual_seed(11)
    expected = torch.rand(8)
    torch.testing.assert_close(torch.cat([a, b]), expected, rtol=0, atol=0)
    # ... and the model-parallel stream is its own seed (seed + 2718 + tp_rank, as megatron's).
    torch.testing.assert_close(forked, torch.rand(4, generator=torch.Generator().manual_seed(11 + 2718)))
    # Megatron's CUDA-only defaults now answer on the CPU.
    assert torch.cuda.current_device() == torch.device("cpu")
    from megatron.core.fusions import fused_softmax

    assert fused_softmax.get_default_causal_mask(3).tolist() == [[False, True, True], [False, False, True],
                                                                 [False, False, False]]


def test_launch_env_sources(monkeypatch, lone_process):
    from kdexp.distributed.launch import first_slurm_host, launch_env

    def _launch_env():
        return dataclasses.astuple(launch_env())

    assert _launch_env()[1:] == (1, 0, "127.0.0.1", None, "local")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08],cpu1")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    # The batch script itself (no srun step) is one process, whatever SLURM_NTASKS says.
    assert _launch_env()[-1] == "local"
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    rank, world, local, addr, port, source = _launch_env()
    assert (rank, world, local, addr, source) == (3, 4, 1, "gpu07", "slurm") and 20000 <= port <= 60000
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert _launch_env() == (1, 2, 0, "127.0.0.1", 29555, "torchrun")
    assert first_slurm_host("node1") == "node1" and first_slurm_host("a[1,3-4]") == "a1"


def test_a_one_process_job_does_not_need_its_derived_port(monkeypatch, lone_process):
    """A one-task submitit or SLURM job gets a port derived from its job id; a sweep point under the local launcher
    once failed with EADDRINUSE on it. A single process has nothing to agree on: it binds a port of the OS's choice."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(kd, "launch_env", lambda: Launch(0, 1, 0, "127.0.0.1", port, "submitit"))
        st = kd.initialize(seed=1)
        assert (st.rank, st.world_size) == (0, 1) and torch.distributed.is_initialized()


def _fails_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def test_run_on_processes_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 ---.*ValueError: boom from rank 1"):
        run_on_processes(_fails_on_rank1, 2)


def _what_a_rank_sees(rank, world_size):
    print(f"rank {rank} says hello", flush=True)
    print(f"rank {rank} warns", file=sys.stderr, flush=True)
    return {"env": os.environ.get("KDEXP_TEST_MARK"), "cwd": os.getcwd(), "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(), "rank_env": os.environ["RANK"], "path": list(sys.path)}


def test_ranks_see_the_callers_environment_directory_and_streams_at_each_call(monkeypatch, tmp_path, capfd):
    """The ranks are forked from a fork server that outlives one call: each call's ranks still get what spawned
    ones would get at that call (the environment and working directory then, sys.path, this test's stdout/stderr)."""
    run_on_processes(_fails_on_rank1, 1)  # the server is up before what follows changes
    monkeypatch.setenv("KDEXP_TEST_MARK", "second call")
    monkeypatch.chdir(tmp_path)
    got = run_on_processes(_what_a_rank_sees, 2)
    assert [g["env"] for g in got] == ["second call"] * 2 and [g["rank_env"] for g in got] == ["0", "1"]
    assert [g["cwd"] for g in got] == [str(tmp_path)] * 2 and [g["torch_threads"] for g in got] == [1, 1]
    assert len({got[0]["pid"], got[1]["pid"], os.getpid()}) == 3 and got[0]["path"] == sys.path
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 0 warns" in err and "rank 1 warns" in err, err


@pytest.mark.parametrize("clean", [True, False])
def test_the_process_group_is_destroyed_at_exit_after_a_clean_end_only(clean):
    # gloo's worker threads otherwise abort the interpreter's exit now and then (SIGABRT: a finished TP 2 run that
    # torchrun reports as failed); after a failure a peer may still wait in a collective, so the group is left alone
    import subprocess
    import sys

    code = ("import atexit, torch.distributed as dist\n"
            "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))  # runs after kdexp's\n"
            "from kdexp import distributed\n"
            "distributed.initialize()\n"
            + ("distributed.ended_cleanly()\n" if clean else ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"initialized at exit: {not clean}" in r.stdout
