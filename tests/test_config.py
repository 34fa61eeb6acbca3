"""Config composition and value checks: wrong types/keys fail at compose time, bad values before anything is built."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import kdexp.conf  # noqa: F401  (registers the schema and resolvers)
from kdexp.config import config_hash, validate


def cfg_of(*overrides: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_composes_and_validates():
    cfg = cfg_of()
    validate(cfg)
    assert cfg.loss.name == "topk" and cfg.loss.ghost_token and cfg.balancer.alpha == 0.9
    assert cfg.model.teacher == "tiny-teacher" and cfg.data.name == "stdlib"


@pytest.mark.parametrize("group", ["loss=dense", "loss=topk", "loss=top_p", "loss=renorm_topk", "balancer=alpha",
                                   "balancer=dynamic", "logger=none", "arm=before", "arm=after", "arm=top_p",
                                   "arm=sampled", "loss=sampled", "experiment=smoke"])
def test_every_group_option_validates(group):
    validate(cfg_of(group))


def test_arms_select_their_loss_and_balancer():
    before = cfg_of("arm=before")
    assert (before.loss.normalization, before.loss.ghost_token, before.balancer.name) == ("renormalize", False,
                                                                                          "dynamic")
    assert before.balancer.skip_lm_loss is True and before.experiment_arm == "before"
    after = cfg_of("arm=after")
    assert (after.loss.normalization, after.loss.ghost_token, after.balancer.alpha) == ("full", True, 0.9)


def test_unknown_key_and_wrong_type_fail_at_compose():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        cfg_of("loss.bogus=1")
    with pytest.raises(ConfigCompositionException, match="top_k"):
        cfg_of("loss.top_k=abc")
    with pytest.raises(ConfigCompositionException, match="alpha"):
        cfg_of("balancer.alpha=high")


@pytest.fixture(autouse=True)
def _temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))  # paths.cache resolves here, never ~/.cache/kdexp
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Things on disk the table points at: {d}/corpus.{bin,idx}, {d}/half.bin (no .idx), {d}/tok/tokenizer.json,
    checkpoint dirs with an empty, an empty-object, a head-less and a good config.json, a plain file."""
    d = tmp_path_factory.mktemp("bad_configs")
    (d / "corpus.bin").write_bytes(b"")
    (d / "corpus.idx").write_bytes(b"")
    (d / "half.bin").write_bytes(b"")
    for name, text in (("empty_json", ""), ("no_vocab", "{}"), ("no_heads", '{"vocab_size": 4096}'),
                       ("bad_heads", '{"vocab_size": 4096, "num_attention_heads": 0}'),
                       ("good", '{"vocab_size": 4096, "num_attention_heads": 4, "num_key_value_heads": 2}'),
                       ("notok", "")):
        (d / name).mkdir()
        if name != "notok":
            (d / name / "config.json").write_text(text)
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_text("{}")
    (d / "a_file").write_text("not a directory")
    return d


INDEXED = ["data=indexed", "data.prefixes=[{d}/corpus]", "data.tokenizer={d}/tok"]

# (overrides, the key the message must start with, a regex the rest must match). {d} is the `files` dir.
BAD = [
    # trainer
    (["trainer.lr=-1"], "trainer.lr=-1.0 is invalid", r"finite number > 0$"),
    (["trainer.lr=0"], "trainer.lr", "> 0"),
    (["trainer.lr=inf"], "trainer.lr", "finite number > 0"),
    (["trainer.lr=nan"], "trainer.lr", "finite number > 0"),
    (["trainer.min_lr=-1"], "trainer.min_lr", ">= 0"),
    (["trainer.min_lr=1.0"], "trainer.min_lr", r"\[0, trainer.lr=0.002\]"),
    (["trainer.min_lr=nan"], "trainer.min_lr", "finite"),
    (["trainer.weight_decay=-1"], "trainer.weight_decay", ">= 0"),
    (["trainer.weight_decay=inf"], "trainer.weight_decay", "finite"),
    (["trainer.grad_clip=nan"], "trainer.grad_clip", "finite number >= 0"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip", ">= 0"),
    (["trainer.seed=-1"], "trainer.seed", r"\[0, 4294967295\]"),
    (["trainer.seed=4294967296"], "trainer.seed", r"\[0, 4294967295\]"),
    (["data.seed=-1"], "data.seed", r"\[0, 4294967295\]"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps", ">= 0"),
    (["trainer.warmup_steps=201"], "trainer.warmup_steps", r"trainer.max_steps=200"),
    (["trainer.max_steps=0"], "trainer.max_steps", ">= 1"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size", ">= 1"),
    (["trainer.seq_length=0"], "trainer.seq_length", ">= 1"),
    (["trainer.seq_length=8192"], "trainer.seq_length", "max_position_embeddings 4096"),
    (["trainer.eval_interval=0"], "trainer.eval_interval", ">= 1"),
    (["trainer.eval_iters=0"], "trainer.eval_iters", ">= 1"),
    (["trainer.log_interval=0"], "trainer.log_interval", ">= 1"),
    (["trainer.checkpoint_interval=-3"], "trainer.checkpoint_interval", ">= 1"),
    (["trainer.skip_nonfinite=-1"], "trainer.skip_nonfinite", ">= 0"),
    (["trainer.global_batch_size=6"], "trainer.global_batch_size=6", r"multiple of .* = 4 x 1 = 4$"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size", ">= 1"),
    (["trainer.precision=fp16"], "trainer.precision", "fp32, bf16"),
    (["trainer.recompute=some"], "trainer.recompute", "none, selective, full"),
    (["trainer.optimizer=sgd"], "trainer.optimizer", "auto, torch, megatron"),
    (["trainer.optimizer=torch", "trainer.distributed_optimizer=true"], "trainer.distributed_optimizer",
     "needs the megatron optimizer"),
    (["trainer.gpu_memory_gb=0"], "trainer.gpu_memory_gb=0.0 is invalid", r"finite number > 0$"),
    (["trainer.gpu_peak_tflops=-1"], "trainer.gpu_peak_tflops=-1.0 is invalid", r"finite number > 0$"),
    (["trainer.lr=${{trainer.nothing}}"], "trainer.lr='${trainer.nothing}' is invalid", "Interpolation key"),
    # data
    (["data.name=web"], "data.name", "stdlib, indexed"),
    (["data.max_chars=100"], "data.max_chars", ">= 1000"),
    (["data.max_documents=1"], "data.max_documents", ">= 2"),
    (["data.val_fraction=0"], "data.val_fraction", r"\(0, 0.5\)"),
    (["data.val_fraction=0.9"], "data.val_fraction", r"\(0, 0.5\)"),
    (["data.val_fraction=nan"], "data.val_fraction", "finite"),
    (["data.vocab_size=300"], "data.vocab_size", r"\[512, 262144\]"),
    (["data.split='1,2'"], "data.split", "'train,valid,test'"),
    (["data.split='0,0,0'"], "data.split", "positive sum"),
    (["data.split='a,b,c'"], "data.split", "non-negative numbers"),
    (["data.prefixes=[{d}/corpus]"], "data.prefixes", "data=stdlib ignores it"),
    (["data=indexed"], "data.prefixes=[]", "at least one"),
    (["data=indexed", "data.prefixes=[]"], "data.prefixes", "at least one"),
    (["data=indexed", "data.prefixes=[/nonexistent]"], "data.prefixes", r"/nonexistent.bin and /nonexistent.idx"),
    (["data=indexed", "data.prefixes=[{d}/half]", "data.tokenizer={d}/tok"], "data.prefixes", r"half.idx\)$"),
    (["data=indexed", "data.prefixes=[0.5,{d}/corpus,-1,{d}/corpus]", "data.tokenizer={d}/tok"], "data.prefixes",
     "blend weight -1 must be a finite number > 0"),
    (["data=indexed", "data.prefixes=[0.5,{d}/corpus,{d}/corpus,{d}/corpus]", "data.tokenizer={d}/tok"],
     "data.prefixes", "not a mix"),
    ([*INDEXED, "data.valid_prefixes=[{d}/nothing]"], "data.valid_prefixes", "no indexed dataset"),
    ([*INDEXED, "data.split='100,0,0'"], "data.split", "valid > 0"),
    ([*INDEXED, "data.max_documents=10"], "data.max_documents", "data=indexed ignores it"),
    (["data=indexed", "data.prefixes=[{d}/corpus]"], "data.tokenizer=None", "tokenizer.json"),
    (["data=indexed", "data.prefixes=[{d}/corpus]", "data.tokenizer={d}/notok"], "data.tokenizer", "tokenizer.json"),
    (["data=indexed", "data.prefixes=[{d}/corpus]", "model.teacher_path={d}/good"], "model.teacher_path",
     "tokenizer.json"),
    # model
    (["model.teacher_path={d}/empty_json"], "model.teacher_path", "not readable JSON"),
    (["model.teacher_path={d}/no_vocab"], "model.teacher_path", "config.json has no 'vocab_size'"),
    (["model.teacher_path={d}/no_heads"], "model.teacher_path", "config.json has no 'num_attention_heads'"),
    (["model.teacher_path={d}/bad_heads"], "model.teacher_path",
     r"num_attention_heads=0 \(must be a positive integer\)$"),
    (["model.student_path={d}/no_vocab"], "model.student_path", "no 'vocab_size'"),
    (["model.teacher_path=/nonexistent/ckpt"], "model.teacher_path", "config.json"),
    (["model=qwen3"], "model.teacher_path=None", "required for the real teacher model.teacher='1.7b'"),
    (["model.teacher_path=???"], "model.teacher_path='???'", "must be set"),
    (["model.teacher=8b"], "model.teacher_path", "required"),
    (["model.teacher=giant"], "model.teacher", "tiny-teacher"),
    (["model.student=giant"], "model.student", "tiny-student"),
    (["model.params_dtype=float8"], "model.params_dtype", "bfloat16"),
    (["model.embedded_teacher=cloud"], "model.embedded_teacher", "shipped, pretrain"),
    (["model.attention=flash"], "model.attention", "must be one of sdpa, megatron"),
    (["data.vocab_size=4096"], "data.vocab_size", "must be 2048 with model.embedded_teacher=shipped .*embedded_teacher=pretrain"),
    (["model.teacher=tiny-student"], "model.teacher", "'tiny-teacher' with model.embedded_teacher=shipped"),
    (["model.teacher_pretrain_steps=0"], "model.teacher_pretrain_steps", ">= 1"),
    (["model.teacher_pretrain_lr=nan"], "model.teacher_pretrain_lr", "finite number > 0"),
    (["model.teacher_pretrain_min_lr=-1e-4"], "model.teacher_pretrain_min_lr", ">= 0"),
    (["model.teacher_pretrain_lr=1e-3", "model.teacher_pretrain_min_lr=2e-3"], "model.teacher_pretrain_min_lr",
     "<= model.teacher_pretrain_lr=0.001"),
    (["model.teacher_pretrain_warmup_fraction=1.0"], "model.teacher_pretrain_warmup_fraction", r"\[0, 1\)"),
    (["model.teacher_pretrain_micro_batch_size=0"], "model.teacher_pretrain_micro_batch_size", ">= 1"),
    (["model.teacher_pretrain_weight_decay=-0.1"], "model.teacher_pretrain_weight_decay", ">= 0"),
    (["model.teacher_pretrain_seed=4294967296"], "model.teacher_pretrain_seed", r"\[0, 4294967295\]"),
    (["model.teacher_pretrain_seq_length=0"], "model.teacher_pretrain_seq_length", ">= 1"),
    (["model.embedded_teacher=pretrain", "model.teacher_pretrain_seq_length=100000"],
     "model.teacher_pretrain_seq_length", "must be <= the teacher's max_position_embeddings"),
    # parallel
    (["parallel.tensor=3"], "parallel.tensor", "teacher's 4 attention heads"),
    (["parallel.tensor=0"], "parallel.tensor", ">= 1"),
    (["parallel.pipeline=2"], "parallel.pipeline", "must be 1"),
    (["parallel.sequence=true"], "parallel.sequence", "needs parallel.tensor > 1"),
    (["parallel.tensor=2", "parallel.sequence=true", "trainer.seq_length=255"], "parallel.sequence",
     "seq_length=255 divisible by parallel.tensor=2"),
    # logger, paths
    (["logger.wandb.mode=sometimes"], "logger.wandb.mode", "online, offline, disabled, null"),
    (["logger=none", "logger.wandb.mode=online"], "logger.wandb.mode", "W&B is off .* would be ignored"),
    (["logger.wandb.project=''"], "logger.wandb.project", "non-empty"),
    (["logger.wandb.tags=['']"], "logger.wandb.tags", "1 to 64 characters"),
    (["paths.cache={d}/a_file"], "paths.cache", "not a file"),
    (["launch.local_parallel=0"], "launch.local_parallel", ">= 1"),
    (["launch.cpu_threads=0"], "launch.cpu_threads", ">= 1"),
    # loss and balancer (their rules live with the losses room; validate calls them)
    (["loss=top_p", "loss.top_p=1.5"], "loss.top_p", r"\(0, 1\]"),
    (["loss=top_p", "loss.top_p=0"], "loss.top_p", r"\(0, 1\]"),
    (["balancer.alpha=-0.1"], "balancer.alpha", r"\[0, 1\]"),
    (["balancer.alpha=1.5"], "balancer.alpha", r"\[0, 1\]"),
    (["loss.top_k=8", "loss.min_k=16"], "loss.min_k", "loss.top_k=8"),
    (["loss.min_k=0"], "loss.min_k", ">= 1"),
    (["loss.top_k=0"], "loss.top_k", ">= 1"),
    (["loss.top_k=5000"], "loss.top_k", "vocabulary size 2048"),
    (["loss.fused_head=maybe"], "loss.fused_head='maybe'", "must be auto, true or false"),
    (["loss.fused_head=1"], "loss.fused_head=1", "must be auto, true or false"),
    (["loss.temperature=0"], "loss.temperature", "> 0"),
    (["loss.temperature=inf"], "loss.temperature", "(finite|inf)"),
    (["loss=top_p", "loss.min_k=5000"], "loss.min_k", "2048"),
    (["balancer=dynamic", "balancer.alpha=5"], "balancer.alpha", "(dynamic|ignore)"),
    (["loss.divergence=hellinger"], "loss.divergence", "forward_kl"),
    (["loss.normalization=softmax"], "loss.normalization", "renormalize"),
    (["model.vocab_alignment=padded"], "model.vocab_alignment", "exact, tokenizer"),
    (["loss=renorm_topk", "loss.ghost_token=true"], "loss.ghost_token", "renormalize"),
]


def _ids(case):
    return " ".join(case[0]).replace("{d}/", "")


@pytest.mark.parametrize("overrides, key, allowed", BAD, ids=[_ids(c) for c in BAD])
def test_bad_values_name_the_key(files, overrides, key, allowed):
    with pytest.raises(ValueError) as err:
        validate(cfg_of(*(o.format(d=files) for o in overrides)))
    message = str(err.value)
    assert "\n" not in message, message  # one line
    assert message.startswith(key), message
    assert re.search(allowed, message), message


def test_the_table_holds_every_rule_family():
    keys = {re.match(r"[\w.]+", key).group(0) for _, key, _ in BAD}
    assert len(BAD) >= 40
    from kdexp.config import KdexpConfig

    schema = OmegaConf.structured(KdexpConfig)
    for group in ("trainer", "data", "model"):  # every key of these groups has a bad case in the table
        for name in schema[group]:
            if name not in ("reuse_finished", "export_hf", "distributed_optimizer", "overwrite"):  # booleans: a wrong type fails at compose
                assert f"{group}.{name}" in keys, f"{group}.{name}"


def test_good_indexed_and_checkpoint_configs_validate(files):
    validate(cfg_of(*(o.format(d=files) for o in INDEXED)))
    validate(cfg_of(*(o.format(d=files) for o in INDEXED), "data.prefixes=[0.3,{d}/corpus,0.7,{d}/corpus]".format(
        d=files), "data.valid_prefixes=[{d}/corpus]".format(d=files), "data.split='1,0,0'"))
    validate(cfg_of(f"model.teacher_path={files}/good", f"model.student_path={files}/good",
                    f"data.tokenizer={files}/tok"))
    validate(cfg_of("trainer.warmup_steps=200", "trainer.min_lr=0.002", "trainer.grad_clip=0", "trainer.seed=0"))


def test_tensor_parallel_must_divide_the_vocabulary():
    # 4 heads / 2 kv heads (teacher and student): TP=2 divides the heads and only fails on an odd vocabulary
    validate(cfg_of("parallel.tensor=2"))
    with pytest.raises(ValueError, match=r"^parallel.tensor=2 is invalid: must divide the vocabulary size 4095$"):
        validate(cfg_of("parallel.tensor=2", "data.vocab_size=4095", "model.embedded_teacher=pretrain"))


def test_tensor_parallel_must_divide_the_world_size(monkeypatch):
    """The launcher's world size (kdexp.distributed.launch: torchrun's or an srun step's), not one variable."""
    for var in ("RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    validate(cfg_of("parallel.tensor=2"))  # a lone process (printing or planning a TP=2 run): nothing to check
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^parallel.tensor=2 is invalid: must divide the world size 3 \(launched "
                                         r"by torchrun\)$"):
        validate(cfg_of("parallel.tensor=2"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    validate(cfg_of("parallel.tensor=2"))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    for var, value in (("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3"), ("SLURM_STEP_ID", "0"), ("SLURM_LOCALID", "0"),
                       ("SLURM_JOB_NODELIST", "node1"), ("SLURM_JOB_ID", "7")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=r"must divide the world size 3 \(launched by slurm\)$"):
        validate(cfg_of("parallel.tensor=2"))


def test_global_batch_must_divide_by_micro_times_data_parallel(monkeypatch):
    validate(cfg_of("trainer.global_batch_size=16"))  # 4 accumulation steps of micro 4 on one rank
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun, TP=2 x DP=2: micro 4 x DP 2 = 8 samples per accumulation step
    validate(cfg_of("parallel.tensor=2", "trainer.global_batch_size=16"))
    with pytest.raises(ValueError, match=r"^trainer.global_batch_size=12 is invalid: .* = 4 x 2 = 8$"):
        validate(cfg_of("parallel.tensor=2", "trainer.global_batch_size=12"))
    from kdexp.config.checks import accumulation_steps

    assert accumulation_steps(None, 4, 2) == 1 and accumulation_steps(32, 4, 2) == 4 and accumulation_steps(8, 8, 1) == 1


def test_removed_modelopt_keys_point_to_alpha():
    with pytest.raises(ValueError, match=r"balancer.skip_lm_loss.*use balancer.alpha.*alpha=1.0"):
        validate(cfg_of("balancer.skip_lm_loss=true"))
    with pytest.raises(ValueError, match=r"balancer.kd_loss_scale.*use balancer.alpha"):
        validate(cfg_of("balancer.kd_loss_scale=2.0"))


def _hf_dir(tmp_path, name, vocab, heads=4, kv=2):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab, "num_attention_heads": heads,
                                               "num_key_value_heads": kv}))
    return d


def test_teacher_student_vocabulary_mismatch(tmp_path):
    t = _hf_dir(tmp_path, "t", 4096)
    s = _hf_dir(tmp_path, "s", 4000)
    with pytest.raises(ValueError, match=r"teacher vocabulary \(4096\).*student vocabulary \(4000\)"):
        validate(cfg_of(f"model.teacher_path={t}", f"model.student_path={s}"))


def test_config_hash_ignores_logging_paths_and_launch_only():
    base = config_hash(cfg_of())
    assert config_hash(cfg_of("logger=none")) == base
    assert config_hash(cfg_of("paths.cache=/elsewhere")) == base
    assert config_hash(cfg_of("launch.local_parallel=2", "launch.cpu_threads=1")) == base  # how, not what
    assert config_hash(cfg_of("balancer.alpha=0.5")) != base
    assert config_hash(cfg_of("loss=top_p")) != base
    assert OmegaConf.select(cfg_of(), "paths.index").endswith("points")


# ---------------------------------------------------------------------------------------------------------------------
# One set of defaults: the schema. What each option of every group changes against it.
CONF = Path(kdexp.conf.__file__).parent
OPTION_CHANGES = {
    ("model", "qwen3_tiny"): {},
    ("model", "qwen3"): {"teacher": "1.7b", "student": "0.6b", "params_dtype": "bfloat16"},
    ("data", "stdlib"): {},
    ("data", "indexed"): {"name": "indexed"},
    ("trainer", "default"): {},
    ("logger", "default"): {},
    ("logger", "none"): {"name": "none", "wandb": {"enabled": False}, "tensorboard": False},
    ("loss", "topk"): {},
    ("loss", "dense"): {"name": "dense", "top_k": None, "ghost_token": False},
    ("loss", "top_p"): {"name": "top_p", "top_k": None, "top_p": 0.95, "min_k": 4},
    ("loss", "renorm_topk"): {"name": "renorm_topk", "ghost_token": False, "normalization": "renormalize"},
    ("loss", "sampled"): {"name": "sampled", "top_k": None, "ghost_token": False, "samples": 64},
    ("balancer", "alpha"): {},
    ("balancer", "dynamic"): {"name": "dynamic", "alpha": None, "kd_loss_scale": 1.0, "skip_lm_loss": True},
    ("teacher", "online"): {},
    ("teacher", "cached"): {"name": "cached"},
}


def _own_keys(path: Path) -> dict:
    """The values a group file sets (its defaults list aside), as a plain dict."""
    node = OmegaConf.load(path)
    data = OmegaConf.to_container(node) if node is not None else {}
    data = data or {}
    data.pop("defaults", None)
    return data


def test_every_option_of_the_groups_is_listed():
    on_disk = {(p.parent.name, p.stem) for g in ("model", "data", "trainer", "logger", "loss", "balancer",
                                                             "teacher")
               for p in (CONF / g).glob("*.yaml")}
    assert on_disk == set(OPTION_CHANGES)


@pytest.mark.parametrize("group, option", sorted(OPTION_CHANGES))
def test_option_is_the_schema_default_plus_its_own_changes(group, option):
    from kdexp.config import KdexpConfig

    changes = OPTION_CHANGES[(group, option)]
    assert _own_keys(CONF / group / f"{option}.yaml") == changes  # the file holds only what the option changes
    expected = OmegaConf.merge(OmegaConf.structured(KdexpConfig)[group], changes)
    composed = cfg_of(f"{group}={option}")
    assert OmegaConf.to_container(composed[group]) == OmegaConf.to_container(expected)
    rest = OmegaConf.to_container(composed, resolve=True)
    default = OmegaConf.to_container(cfg_of(), resolve=True)
    rest.pop(group), default.pop(group)
    assert rest == default  # nothing outside its group moves


def _leaves(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("path", sorted(p.relative_to(CONF).as_posix() for g in ("experiment", "arm")
                                        for p in (CONF / g).glob("*.yaml")))
def test_experiment_and_arm_files_set_no_value_they_would_get_anyway(path):
    """An experiment or arm sets only values that differ from what its selected groups give without it."""
    option = f"{Path(path).parent.name}={Path(path).stem}"
    own = {k: v for k, v in _leaves(_own_keys(CONF / path)) if not k.startswith("hydra")}
    picked = [d.replace("override /", "").replace(": ", "=") for d in (OmegaConf.load(CONF / path).get("defaults")
                                                                       or []) if isinstance(d, str)]
    picked += [f"{k.replace('override /', '')}={v}" for d in (OmegaConf.load(CONF / path).get("defaults") or [])
               if not isinstance(d, str) for k, v in d.items()]
    without = cfg_of(*picked)
    with_it = cfg_of(option)
    for key, value in own.items():
        assert OmegaConf.select(with_it, key) == value, key
        assert OmegaConf.select(without, key) != value, f"{path}: {key}={value} is already the default"


# ---------------------------------------------------------------------------------------------------------------------
# The loss and balancer groups build through their one factory (kdexp.objective uses the same calls).
@pytest.mark.parametrize("option", ["loss=topk", "loss=dense", "loss=top_p", "loss=renorm_topk", "arm=before"])
def test_every_loss_option_gives_the_keywords_of_the_loss(option):
    import torch

    from _kd_reference import reference_kd
    from kdexp.losses import KDLossOptions, logits_kd_loss

    kw = KDLossOptions.from_config(cfg_of(option).loss).kwargs()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 1100, generator=g, dtype=torch.float64) * 3
    s = t + torch.randn(2, 1100, generator=g, dtype=torch.float64)
    ref, _ = reference_kd(s, t, **kw)
    torch.testing.assert_close(logits_kd_loss(s.float(), t.float(), **kw).double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, built", [
    ([], "AlphaBalancer(alpha=0.9)"), (["balancer.alpha=0.25"], "AlphaBalancer(alpha=0.25)"),
    (["balancer=dynamic"], "DynamicBalancer(kd_loss_scale=1.0, skip_lm_loss=True)"),
    (["balancer=dynamic", "balancer.kd_loss_scale=null", "balancer.skip_lm_loss=false"],
     "DynamicBalancer(kd_loss_scale=1.0, skip_lm_loss=False)"),
    (["arm=before"], "DynamicBalancer(kd_loss_scale=1.0, skip_lm_loss=True)"),
])
def test_the_trainer_builds_the_configured_balancer(overrides, built):
    from kdexp.objective import build_balancer

    assert repr(build_balancer(cfg_of(*overrides).balancer)) == built
