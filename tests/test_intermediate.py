"""Hidden-state losses in the run (loss.intermediate): the layer outputs the forward hooks take, the loss and the
projection's gradient against a float64 hand computation from transformers' own hidden states; TP=2 equal to TP=1;
the config errors (layer out of range, unknown kind, missing index); a tiny run logs train/intermediate_loss and
exports a student without the projection."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from _lone_process import lone_process
from test_config import cfg_of

import kdexp.distributed as kd
from kdexp.config import validate
from kdexp.distributed.testing import run_on_processes
from kdexp.models import capture_hidden, load_hf, vocab_parallel_logits
from kdexp import objective

VOCAB = 128
PAIRS = [SimpleNamespace(student=0, teacher=1, kind="cosine"), SimpleNamespace(student=1, teacher=0, kind="mse")]
LOSS = SimpleNamespace(intermediate=PAIRS)


def _hf(hidden: int, layers: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, max_position_embeddings=64,
                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, attn_implementation="eager")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A teacher (hidden 64, 3 layers) and a student (hidden 32, 3 layers) as HF checkpoints, with transformers'
    hidden states on fixed inputs (hidden_states[i + 1] is layer i's output; the last one is after the final norm,
    so only layers 0 and 1 are compared)."""
    root = tmp_path_factory.mktemp("hidden")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12)
    mask[1, 7:] = 0.0
    out = {"ids": ids, "mask": mask}
    for role, hidden, seed in (("teacher", 64, 1), ("student", 32, 2)):
        model = _hf(hidden, 3, seed)
        model.save_pretrained(root / role, safe_serialization=True)
        with torch.no_grad():
            out[role] = (str(root / role), [h.double() for h in model(ids, output_hidden_states=True).hidden_states])
    return out


def _run(pair, tp_group_ready=True):
    """Load both, attach the projections (seeded), forward under the hooks, the loss and its backward."""
    teacher, student = load_hf(pair["teacher"][0]), load_hf(pair["student"][0])
    kd.reseed(11)
    objective.attach_intermediate(student, LOSS, teacher.kdexp_spec.hidden_size)
    s_layers, t_layers = objective.intermediate_layers(LOSS)
    with torch.no_grad(), capture_hidden(teacher, t_layers) as t_hidden:
        vocab_parallel_logits(teacher, pair["ids"])
    with capture_hidden(student, s_layers) as s_hidden:
        vocab_parallel_logits(student, pair["ids"])
    loss = objective.intermediate_loss(student, LOSS, s_hidden, t_hidden, pair["mask"])
    loss.backward()
    mods = getattr(student, objective.INTERMEDIATE_ATTR)
    return {"loss": loss.detach(), "weights": [(m.projection.weight.detach(), m.projection.bias.detach()) for m in mods],
            "grads": [m.projection.weight.grad for m in mods],
            "hidden": {k: v.detach() for k, v in {**{f"s{i}": s_hidden[i] for i in s_layers},
                                                   **{f"t{i}": t_hidden[i] for i in t_layers}}.items()},
            "decoder_grad": student.decoder.layers[0].mlp.linear_fc2.weight.grad is not None}


def _reference(pair, weights):
    """By hand in float64 from transformers' hidden states: 1 - cos(W s + b, t) and mean((W s + b - t)^2), masked
    means over tokens, then the mean over the pairs; differentiable w.r.t. the projection weights."""
    mask = pair["mask"].double()
    ws = [w.double().clone().requires_grad_(True) for w, _ in weights]
    losses = []
    for p, w, (_, b) in zip(PAIRS, ws, weights):
        s = pair["student"][1][p.student + 1] @ w.T + b.double()
        t = pair["teacher"][1][p.teacher + 1]
        if p.kind == "cosine":
            per = 1 - (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))
        else:
            per = ((s - t) ** 2).mean(-1)
        losses.append((per * mask).sum() / mask.sum())
    total = sum(losses) / len(losses)
    total.backward()
    return total.detach(), [w.grad for w in ws]


def test_hidden_states_loss_and_projection_gradient_match_a_hand_computation(pair, monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch):
        res = _run(pair)
    for p in PAIRS:  # the hooks take exactly transformers' layer outputs ([s, b, h] -> [b, s, h])
        torch.testing.assert_close(res["hidden"][f"s{p.student}"].transpose(0, 1).double(),
                                   pair["student"][1][p.student + 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["hidden"][f"t{p.teacher}"].transpose(0, 1).double(),
                                   pair["teacher"][1][p.teacher + 1], rtol=1e-4, atol=1e-5)
    ref, ref_grads = _reference(pair, res["weights"])
    torch.testing.assert_close(res["loss"].double(), ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(res["grads"], ref_grads):
        assert tuple(g.shape) == (64, 32)  # the projection: student hidden 32 -> teacher hidden 64
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-6)
    assert res["decoder_grad"]  # the student's own layers are trained through the hidden-state loss too


def test_the_balancer_adds_it_scaled_to_the_logits_loss_with_a_detached_factor():
    from kdexp.losses import AlphaBalancer

    lm = torch.tensor(4.0, requires_grad=True)
    kd_loss = torch.tensor(2.5, requires_grad=True)
    inter = torch.tensor(0.1, requires_grad=True)
    total, _ = AlphaBalancer(alpha=0.9)(lm, kd_loss, inter)  # what train_step calls
    total.backward()
    assert float(total.detach()) == pytest.approx(0.1 * 4.0 + 0.9 * (2.5 + 2.5))  # kd + inter * |kd| / |inter|
    assert float(kd_loss.grad) == pytest.approx(0.9) and float(inter.grad) == pytest.approx(0.9 * 25.0)  # constant


def _tp2_worker(rank, world, pair):
    kd.initialize(tensor_parallel=2, seed=5)
    return _run(pair)


@pytest.mark.slow
def test_tp2_equals_tp1(pair, monkeypatch):
    with lone_process(seed=5, monkeypatch=monkeypatch):
        ref = _run(pair)
    for rank, res in enumerate(run_on_processes(_tp2_worker, 2, args=(pair,))):
        torch.testing.assert_close(res["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {m}")
        for (w, b), (rw, rb) in zip(res["weights"], ref["weights"]):  # same init on every TP rank
            assert torch.equal(w, rw) and torch.equal(b, rb)
        for g, r in zip(res["grads"], ref["grads"]):  # replicated hidden states: full, equal grads on each rank
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override,says", [
    ("loss.intermediate=[{student: 2, teacher: 1}]", r"loss.intermediate\[0\].student=2 is invalid: must be a layer "
                                                     r"index in \[0, 1\] \(the student has 2 layers\)"),
    ("loss.intermediate=[{student: 0, teacher: 0},{student: 1, teacher: 4}]",
     r"loss.intermediate\[1\].teacher=4 is invalid: must be a layer index in \[0, 3\]"),
    ("loss.intermediate=[{student: 0, teacher: -1}]", r"loss.intermediate\[0\].teacher=-1 is invalid"),
    ("loss.intermediate=[{student: 0, teacher: 1, kind: l1}]", r"loss.intermediate\[0\].kind='l1' is invalid: must "
                                                               r"be one of cosine, mse"),
])
def test_bad_pairs_are_config_errors(override, says):
    with pytest.raises(ValueError, match=says):
        validate(cfg_of(override))


def test_a_pair_without_an_index_fails_at_compose_or_validate():
    with pytest.raises(Exception, match="teacher"):
        validate(cfg_of("loss.intermediate=[{student: 1}]"))


def test_a_cached_teacher_refuses_hidden_state_losses():
    validate(cfg_of("loss.intermediate=[{student: 1, teacher: 3}]"))
    with pytest.raises(ValueError, match="loss.intermediate=.* needs the online teacher's hidden states"):
        validate(cfg_of("loss.intermediate=[{student: 1, teacher: 3}]", "teacher=cached", "loss.top_k=64"))


def _train(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


@pytest.mark.slow
def test_a_sampled_run_with_hidden_state_losses_resumes_exactly_and_exports_without_the_projection(tmp_path):
    """loss=sampled + loss.intermediate through kdexp.run: train/intermediate_loss logged, the projection checkpointed
    with the student and left out of the HF export, and a run killed after step 3 (checkpoint at 2) resumes to the
    uninterrupted run's numbers: the same draws (seeded by trainer.seed and the step) and the same projection."""
    from _launch import kdexp_run

    # The session's KDEXP_CACHE (tests/conftest.py): the embedded teacher is pretrained once for all such runs.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KDEXP_RUN_STAMP", None)
    args = ["experiment=smoke", "trainer.max_steps=4", "trainer.eval_interval=2", "trainer.checkpoint_interval=2",
            "logger=none", "loss=sampled", "loss.samples=16", "loss.intermediate=[{student: 1, teacher: 3}]"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    kdexp_run([*args, "trainer.export_hf=true", f"hydra.run.dir={ref}"], env, tmp_path)
    proc = kdexp_run([*args, f"hydra.run.dir={killed}"], env, tmp_path, check=False, kill_at=3)
    assert proc.returncode == -9, proc.stderr[-3000:]
    kdexp_run([*args, f"hydra.run.dir={killed}"], env, tmp_path)

    train = _train(ref)
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    assert all(0 < x["train/intermediate_loss"] <= 2 for x in train)  # 1 - cos is in [0, 2]
    assert all(1 <= x["train/nucleus_size"] <= 16 and 0 < x["train/kept_mass"] <= 1 for x in train)
    resumed = _train(killed)
    assert [x["step"] for x in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, train):
        for key in ("train/loss", "train/kd_loss", "train/intermediate_loss", "train/kept_mass", "train/nucleus_size"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)

    state = torch.load(ref / "checkpoints" / "step_4" / "tp0.pt", weights_only=False)  # kdexp.train.checkpoint
    assert any(k.startswith(objective.INTERMEDIATE_ATTR) for k in state["model"])
    assert json.loads((ref / "student_hf" / "config.json").read_text())["hidden_size"] == 128
    from safetensors import safe_open

    with safe_open(str(ref / "student_hf" / "model.safetensors"), "pt") as f:
        assert f.keys() and not any("kdexp" in k for k in f.keys())
