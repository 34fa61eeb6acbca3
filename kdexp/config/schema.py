"""Typed schema of a kdexp run: the dataclasses Hydra composes against, the one set of defaults.

They are registered in Hydra's ConfigStore as ``kdexp_schema``; ``conf/config.yaml`` puts that schema first in its
defaults list, so a wrong type or an unknown key fails when Hydra composes the config, and a group file holds only
what its option changes. The loss and balancer groups are the option classes of kdexp.losses (their keys are the loss
function's keywords; their value rules live there too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from kdexp.losses.options import BalancerOptions, IntermediatePair, KDLossOptions, SampledKDOptions


@dataclass
class ModelConfig:
    # a size of kdexp.config.qwen3.QWEN3_SIZES in any spelling its size_key reads ("1.7b", "Qwen3-1.7B",
    # "Qwen/Qwen3-1.7B"); optional (null) with a checkpoint path, whose config.json gives the shape and the label; a
    # name given beside a path must be the checkpoint's shape
    teacher: Optional[str] = "tiny-teacher"
    student: Optional[str] = "tiny-student"
    teacher_path: Optional[str] = None  # local HF checkpoint dir; required for real (non-tiny) teachers
    student_path: Optional[str] = None  # local HF checkpoint dir to start the student from; None = random init
    params_dtype: str = "float32"  # float32 | bfloat16
    # exact: teacher and student have one vocabulary size; tokenizer: they may differ by padding rows beyond the
    # tokenizer's ids (Qwen2.5's 152,064 vs Qwen3's 151,936): aligned on the real ids, padded rows -inf in both
    # softmaxes (kdexp.models.vocab)
    vocab_alignment: str = "exact"
    # core attention of teacher and student: sdpa (torch's fused scaled_dot_product_attention: flash / memory-efficient
    # kernels, no [s, s] score tensor) | megatron (megatron-core's unfused DotProductAttention)
    attention: str = "sdpa"
    # Embedded default only (no teacher_path): `shipped` loads the teacher trained once by this project's recipe and
    # shipped with the package with its tokenizer (kdexp/assets/teacher); `pretrain` pretrains one here with the
    # recipe below, once per cache (kdexp.train.teacher).
    embedded_teacher: str = "shipped"  # shipped | pretrain
    # model.embedded_teacher=pretrain: the tiny teacher is pretrained on the corpus once, then cached. The recipe is
    # the best of those compared at the same CPU cost (docs/benchmarks.md, python -m kdexp.bench.teacher --curve).
    teacher_pretrain_steps: int = 600
    teacher_pretrain_lr: float = 3e-3
    teacher_pretrain_min_lr: float = 3e-4  # cosine floor after the warmup
    teacher_pretrain_warmup_fraction: float = 0.05  # of the steps, linear (at least one step)
    teacher_pretrain_micro_batch_size: int = 4  # samples per step and data-parallel rank
    teacher_pretrain_weight_decay: float = 0.01
    # its own seed (its initialisation), not trainer.seed: every replicate of a seed sweep distils the same teacher
    teacher_pretrain_seed: int = 1234
    # the length of its samples; a run with a longer trainer.seq_length pretrains at that length instead (a teacher
    # never trained at a position gives untrained logits there), so the runs at or below it share one teacher
    teacher_pretrain_seq_length: int = 256


@dataclass
class LossConfig(KDLossOptions, SampledKDOptions):
    """The loss group: the keywords of kdexp.losses.logits_kd_loss (their value rules live there), the sampled-KD keys
    (samples, proposal_temperature: set by loss=sampled), the hidden-state pairs, plus the option's name. The run's
    default is Top-K 1024 with a ghost token (logits_kd_loss's own default is dense)."""

    name: str = "topk"  # the loss=<name> option (kdexp.losses.options.LOSS_NAMES: the one table of loss names)
    top_k: Optional[int] = 1024
    # Hidden-state losses, e.g. [{student: 3, teacher: 11, kind: cosine}] (kdexp.losses.options.IntermediatePair).
    intermediate: List[IntermediatePair] = field(default_factory=list)
    # The output layer fused into the objective (kdexp.losses.head): logits formed chunk by chunk from the final
    # hidden states, never [tokens, vocab] at once; false: the models' whole logits (the reference path); auto: fused
    # where one micro-batch's fp32 logits per TP rank take 64 MiB or more (kdexp.losses.head.uses_fused_head: the
    # Qwen3 presets, not the tiny ones).
    fused_head: Any = "auto"


@dataclass
class BalancerConfig(BalancerOptions):
    """The balancer group: kdexp.losses.BalancerOptions (alpha | dynamic; keys the chosen one ignores are rejected)."""


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | indexed
    # stdlib: size of the BPE trained on the corpus. 2,048 rather than 4,096: over a larger vocabulary the tiny
    # teacher's tail stays flat (docs/benchmarks.md: a 0.95-nucleus of half the vocabulary at 4,096), far from a
    # real LM's tens of tokens.
    vocab_size: int = 2048
    max_chars: int = 4_000_000  # stdlib: cap on the embedded corpus
    val_fraction: float = 0.03
    prefixes: List[str] = field(default_factory=list)  # indexed: Megatron .bin/.idx prefixes (optionally weighted)
    tokenizer: Optional[str] = None  # indexed: dir with tokenizer.json (default: model.teacher_path)
    split: str = "969,30,1"  # indexed: train,valid,test split of each prefix
    valid_prefixes: List[str] = field(default_factory=list)  # indexed: separate validation data (then no split)
    max_documents: Optional[int] = None  # stdlib: cap on the number of documents
    # The samples: megatron's document shuffle and the windows cut from it (one epoch of the training split). Not
    # trainer.seed, so that every replicate of a seed sweep reads the same windows (in its own order) and one
    # offline teacher cache serves them all.
    seed: int = 1234


@dataclass
class TeacherConfig:
    """The teacher group: `online` runs the teacher forward every step; `cached` trains from an offline cache of its
    top-K_max logits + log-sum-exps, or with loss.samples set of sampled KD's draws (kdexp.teacher.format), built
    once (under a lock) by the first run that needs it."""

    name: str = "online"  # online | cached
    # cached: what is stored per token: topk (top-K_max logits + log-sum-exps) | sampled (sampled KD's draws) | hidden
    # (the teacher's final hidden states: its logits formed in the step with its own output layer, so every loss,
    # K, nucleus and temperature is served); null = by the loss (sampled with loss.samples, else topk)
    store: Optional[str] = None
    k_max: int = 1024  # cached: top-K stored per token; serves any loss.top_k <= k_max (unused by sampled KD)
    temperatures: List[float] = field(default_factory=lambda: [1.0])  # cached: the loss.temperature values served
    dtype: str = "float32"  # cached: values stored as float32 (exact) | bfloat16 | float16 (compact)
    shard_samples: int = 64  # cached: samples per shard (the unit of resume and of checksum verification)
    path: Optional[str] = None  # cached: cache directory; null = keyed by its content under paths.cache


@dataclass
class RolloutConfig:
    """The rollout group: where a step's tokens come from. `off`: dataset batches only; `on_policy`: for a fraction of
    the steps the student continues prompts cut from the dataset samples and is trained on its own tokens, scored by
    the teacher (docs/on-policy.md). The sampler keys also set val/onpolicy_reverse_kl's continuations in every run."""

    name: str = "off"  # off | on_policy
    # GKD's lambda: the fraction of steps (every micro-batch of a step alike) trained on the student's own samples;
    # rollout=off takes 0 only
    on_policy_fraction: float = 0.0
    prompt_tokens: int = 16  # the prompt: the first this-many tokens of a dataset sample (of a rollout.prompts line: last)
    # A JSONL file of prompts ({"prompt": text} or {"messages": [{"role", "content"}, ...]} per line), tokenised with
    # the run's tokenizer (its chat template for messages); training sample i continues line i mod lines.
    # null: the prompt is the start of each dataset sample
    prompts: Optional[str] = None
    max_new_tokens: int = 32  # a row stops at the tokenizer's end-of-sequence id or here (counted as truncated)
    temperature: float = 1.0  # the sampler's
    top_p: float = 1.0  # the sampler's nucleus; 1 = the whole vocabulary
    # distribution: the loss group's divergence and cut at every generated position (objective, fused head);
    # sampled_token: per-token reverse KL on the sampled token as the advantage, an importance-sampling loss
    estimator: str = "distribution"
    warmup_steps: int = 0  # off-policy steps before the first rollout


@dataclass
class TrainerConfig:
    max_steps: int = 200
    micro_batch_size: int = 4
    # Samples per optimizer step over all data-parallel ranks; None = micro_batch_size x DP (no accumulation). Else a
    # multiple of micro_batch_size x DP: global / (micro x DP) micro-batches are accumulated per step.
    global_batch_size: Optional[int] = None
    seq_length: int = 256
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_iters: int = 8
    log_interval: int = 10
    checkpoint_interval: int = 50
    # the replicate: the student's initialisation, dropout, the order the training windows are read in (a permutation
    # of them per epoch, kdexp.data.ReadOrder) and sampled KD's draws; the samples themselves are data.seed's
    seed: int = 1234
    skip_nonfinite: int = 0  # non-finite steps to skip (no update) before the run stops as diverged
    reuse_finished: bool = True  # in a sweep, a point whose resolved config already finished is not retrained
    # a run dir that holds another config's run is refused; true deletes that run (checkpoints, metrics, summary,
    # W&B id) and starts over. Not part of the run's identity (kdexp.config.identity).
    overwrite: bool = False
    export_hf: bool = False  # at the end, write the distilled student as a Hugging Face checkpoint (run_dir/student_hf)
    # fp32 | bf16: bf16 = bf16 student weights/activations with fp32 master weights, grads and AdamW state; bf16 teacher
    precision: str = "fp32"
    recompute: str = "none"  # activation recompute: none | selective (core attention) | full (every layer)
    optimizer: str = "auto"  # auto (megatron on CUDA, torch on CPU) | torch | megatron (DDP + get_megatron_optimizer)
    distributed_optimizer: bool = False  # megatron optimizer only: shard the fp32 master weights and AdamW state (ZeRO-1)
    # kdexp.plan: usable memory per GPU in GiB (2**30 bytes, as torch.cuda.get_device_properties reports it);
    # set, kdexp.run refuses a config whose planned peak does not fit. None = no check.
    gpu_memory_gb: Optional[float] = None
    gpu_peak_tflops: float = 989.0  # kdexp.plan's tokens/s estimate: dense bf16 peak per GPU (H100 SXM: 989)


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    sequence: bool = False  # megatron sequence parallelism (activations sharded over the TP group); needs tensor > 1


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: Optional[str] = None  # None: $WANDB_MODE, else "offline"; "online" | "offline" | "disabled"
    project: str = "kdexp"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep's directory name in a sweep, else no group
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    name: str = "default"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = True  # events + HParams in the run dir (kdexp.track.tensorboard); rank 0 only


@dataclass
class PathsConfig:
    cache: str = MISSING  # tokenizer, datasets, the pretrained embedded teacher
    index: str = MISSING  # finished points keyed by their resolved config (sweep re-runs skip them)


@dataclass
class LaunchConfig:
    # How points share this machine (kdexp.track.slots); not part of a point's identity (config_hash), like paths.
    # Points of a submitit-local sweep (hydra/launcher=local_cpu) that train at once; null = one per 2 CPU cores.
    local_parallel: Optional[int] = None
    # torch intra-op CPU threads per process; null = the cores // local_parallel under the local executor, else
    # torch's default.
    cpu_threads: Optional[int] = None


@dataclass
class KdexpConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    experiment_arm: Optional[str] = None  # set by arm/* presets (experiment=qwen3_before_after)


def register() -> None:
    ConfigStore.instance().store(name="kdexp_schema", node=KdexpConfig)


register()
