"""The trainer's settings section (`[trainer]` / `trainer:` in the config file), nested by
concern: the process itself in `[trainer]`, then `[trainer.optim]`, `[trainer.batch]`,
`[trainer.algorithm]`, `[trainer.staleness]`, `[trainer.data]`, `[trainer.checkpoint]`,
`[trainer.push]`, `[trainer.distributed]`, `[trainer.lora]` and `[trainer.logging]`.

A key of the old flat layout (`[trainer] lr = ...`) is refused with the key it moved to
(`MOVED`); environment overrides nest the same way (`FLYWHEEL_TRAINER__OPTIM__LR`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from flywheel.core.section import Section


class OptimSettings(Section):
    """`[trainer.optim]`: AdamW and the learning-rate schedule."""

    lr: float = Field(5e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    state_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of AdamW's two moments. bfloat16 halves the optimizer's memory (the math, the
    weights and each update stay fp32; the moments are stochastically rounded:
    flywheel/trainer/adamw_bf16.py). auto = bfloat16 for plain fp32 parameters on a CPU (where
    the trainer shares the machine's memory with the engine), float32 on CUDA, for FSDP2 shards
    and for bf16 parameters."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global L2 norm before each optimizer step."""
    lr_schedule: Literal["constant", "linear_warmup", "cosine"] = "constant"
    """Learning-rate schedule over optimizer steps (warm-up is linear from 0)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up (linear_warmup, cosine)."""
    total_steps: int = Field(1000, ge=1)
    """Horizon of the cosine decay (to 0) in steps."""


class BatchSettings(Section):
    """`[trainer.batch]`: what makes an optimizer step and how it is cut into micro-batches."""

    groups_per_step: int = Field(4, ge=1)
    """Complete groups (by group_id) per optimizer step."""
    group_size: int = Field(8, ge=1)
    """Samples per group; a group is complete when it has this many."""
    group_wait_s: float = Field(120.0, ge=0)
    """Seconds to wait for a partial group before training on what arrived."""
    step_tokens: int = Field(0, ge=0)
    """Tokens per optimizer step: a step starts once ready groups hold this many and takes
    groups up to it (at least one); 0 = by sample count (`groups_per_step * group_size`)."""
    partial_groups: Literal["train", "drop"] = "train"
    """A group still partial after `group_wait_s`: train it (with >= `min_group_size` fresh
    members) or drop it (counted as `partial_group`)."""
    min_group_size: int = Field(2, ge=1)
    """Fresh members a partial group needs to be trained."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward pass (gradient accumulation over micro-batches)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Tokens per forward/backward pass: padded tokens (rows x longest row) under
    `layout = "padded"` and "shared_prefix", real tokens under "packed"; 0 = only
    `micro_batch_size` limits a micro-batch."""
    layout: Literal["shared_prefix", "padded", "packed"] = "shared_prefix"
    """Micro-batch layout of the forward/backward pass. padded = rows right-padded to the
    longest row (B x T positions); shared_prefix = rows that share a prompt (a group's samples)
    run it once: a micro-batch of up to 1024 positions is one packed pass (each prompt, then its
    rows' suffixes, under a prompt-sharing mask; no padding), a larger one runs the suffixes on
    the prompt's cache (same loss and gradients; rows sharing fewer than 16 tokens with any
    other run on their own); packed = each
    micro-batch's samples end to end in one sequence with per-sample position ids and a
    block-diagonal causal mask (padding-free, same loss and gradients). Packed pays when sample
    lengths differ a lot and samples are short enough that attention (N^2 over the packed N
    tokens) stays small next to the MLPs; bound N with `micro_batch_tokens`, which counts real
    tokens under packed. Measured (bench/trainer.py part 3, SmolLM2-135M on CPU, 8 samples of
    28..112 tokens, micro-batches of 4): padding 34% -> 0%, forward + backward 0.54x the padded
    time (length-sorted padded: 10%, 0.79x). Shared prefix: bench/trainer.py part 4."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Scored tokens per chunk of the lm-head + log-softmax (bounds its memory)."""

    @model_validator(mode="after")
    def _possible_partial_groups(self) -> BatchSettings:
        if self.min_group_size > self.group_size:
            raise ValueError(
                f"min_group_size = {self.min_group_size} > group_size = {self.group_size}: no "
                "partial group could ever be trained; set trainer.batch.min_group_size <= "
                f"{self.group_size}"
            )
        return self


class AlgorithmSettings(Section):
    """`[trainer.algorithm]`: advantage estimator, policy loss, corrections, regularizers and
    every part's parameters (`flywheel algorithms list`)."""

    advantage: str = "grpo"
    """Advantage estimator (flywheel.trainer.algorithms.advantages.ADVANTAGES); its parameters
    are `[trainer.algorithm.params.<name>]` (e.g. `quantile`'s `k`). A group-relative one
    (`algorithm_catalog.group_relative_advantages`) needs `trainer.batch.group_size` >= 2."""
    policy_loss: str = "ppo_clip"
    """Token policy loss (flywheel.trainer.algorithms.losses.POLICY_LOSSES). gspo wants tiny
    clip_eps_low / clip_eps_high (paper: 3e-4 / 4e-4)."""
    loss_aggregation: str = "token_mean"
    """How token losses become one scalar (flywheel.trainer.algorithms.losses.AGGREGATIONS)."""
    clip_eps_low: float = Field(0.2, ge=0)
    """PPO clip: ratio lower bound 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0)
    """PPO clip: ratio upper bound 1 + clip_eps_high (clip-higher when > clip_eps_low)."""
    dual_clip_c: float = Field(0.0, ge=0)
    """Dual-clip bound c (> 1) on the loss of negative-advantage tokens; 0 = off."""
    std_floor: float = Field(1e-3, gt=0)
    """Group reward std below this value is treated as 0 (advantages 0)."""
    rollout_correction: Literal["none", "tis", "mis", "icepop"] = "none"
    """Train-inference correction (flywheel.trainer.algorithms.corrections.CORRECTIONS): token
    weights from the trainer/rollout logprob ratio; the policy ratio is then taken against the
    trainer's own logprobs. none = ratio against the rollout logprobs, no weights."""
    correction_cap: float = Field(2.0, gt=0)
    """C of tis (weights truncated at C) and mis (tokens with ratio > C dropped); also the cap
    of `staleness.policy = "is_correct"`."""
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    """[alpha, beta] of icepop: tokens whose trainer/rollout ratio leaves it are dropped."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the per-token KL(pi || reference) term added to the loss; 0 = off (no
    reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (flywheel.trainer.algorithms.regularizers.KL_ESTIMATORS)."""
    reference_model_path: str = ""
    """Frozen reference policy for the KL term; empty = the initial policy (`model_path`)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Coefficient of the entropy bonus (-coef * H per loss token, nats); 0 = off."""
    live_advantage: Literal["drop", "reward", "opd", "opd_plus_rl"] = "reward"
    """Samples without a group_id (live mode): `reward` = advantage is the sample's reward
    (e.g. a judge's +1/-1), `opd` = per-token teacher - rollout logprob gap, `opd_plus_rl` =
    OpenClaw-RL's combination w_opd * gap + w_rl * reward (a turn with one signal uses that
    one; weights and `gap_clip` in `[trainer.algorithm.params.opd_plus_rl]`), `drop` = dropped
    as `no_group_id`."""
    token_weights: list[str] = Field(default_factory=list)
    """Token weight / mask parts applied in order to the advantages (WEIGHTS in
    flywheel.trainer.algorithms.weights), e.g. ["high_entropy_only"]."""
    regularizers: dict[str, float] = Field(default_factory=dict)
    """Regularizer terms and their coefficients, e.g. {k3 = 0.001, entropy_min = 0.01}
    (KL_ESTIMATORS against the rollout policy, TERMS in ...algorithms.regularizers)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: groups without reward spread are left out of the step."""
    params: dict[str, dict[str, float | int | bool | str]] = Field(default_factory=dict)
    """Per-part hyperparameters over the paper defaults, by part name:
    `[trainer.algorithm.params.high_entropy_only]` / `top_frac = 0.2`."""

    @field_validator(
        "advantage", "policy_loss", "loss_aggregation", "token_weights", "regularizers", "params"
    )
    @classmethod
    def _known_parts(cls, value: Any, info: Any) -> Any:
        from flywheel.core.algorithm_catalog import names_for  # noqa: PLC0415

        known = names_for(info.field_name)
        for name in [value] if isinstance(value, str) else list(value):
            if name not in known:
                raise ValueError(
                    f"unknown {info.field_name} part {name!r}; choose from "
                    f"{', '.join(sorted(known))} (`flywheel algorithms list`)"
                )
        return value

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float) -> float:
        if 0 < value <= 1:
            raise ValueError("dual_clip_c must be 0 (off) or > 1 (e.g. 3.0)")
        return value


class StalenessSettings(Section):
    """`[trainer.staleness]`: samples drawn by older weights than the trainer's."""

    max_staleness: int = Field(4, ge=0)
    """Weight versions a sampled token may lag behind the trainer before `policy` applies (per
    token: a sample's tokens may come from several versions; `trainer/staleness.py`)."""
    policy: Literal["drop", "downweight", "is_correct"] = "drop"
    """Lag beyond `max_staleness`: drop = such tokens leave the loss (a sample with none left
    is dropped); downweight = the sample's losses are multiplied by
    `decay ** (lag - max_staleness)`, lag of its oldest token; is_correct = IS-corrected (ratio
    against the trainer's own logprobs, tokens weighted by min(pi_train / pi_rollout,
    algorithm.correction_cap))."""
    decay: float = Field(0.5, gt=0, le=1)
    """Per-version loss weight decay of `downweight`."""
    hard_limit: int = Field(0, ge=0)
    """Lag above which a token leaves the loss whatever `policy` says (a sample with none
    left is dropped); 0 = no limit."""


class DataSettings(Section):
    """`[trainer.data]`: where Samples come from and which ones are trainable."""

    source: Literal["redis", "replay", "fake"] = "redis"
    """Where Samples come from: the train stream, a recorded dump (`replay_path`), or random
    well-formed groups (to run and profile the step alone)."""
    replay_path: str = ""
    """Dump to replay with `source = "replay"` (.jsonl or length-prefixed .bin of Samples)."""
    record_path: str = ""
    """Append every Sample read from the source to this dump (.jsonl or .bin); empty = off."""
    fake_prompt_tokens: int = Field(32, ge=1)
    """Prompt tokens of each fake Sample."""
    fake_completion_tokens: int = Field(32, ge=1)
    """Sampled tokens of each fake Sample."""
    allow_truncated_sampling: bool = False
    """Train on samples drawn with top_p < 1, top_k > 0 or min_p > 0. Their engine logprobs are
    normalized over a kept set the trainer cannot rebuild (BUG-08); off = drop them, counted."""
    unjudged: Literal["drop", "keep"] = "drop"
    """Samples a configured judge could not judge (error "unjudged: ...", has_reward false):
    drop = dead-letter them as no_reward; keep = train on their other reward components (their
    `reward` is the weighted sum of those) when they have any (`samples.keepable_unjudged`)."""


class CheckpointSettings(Section):
    """`[trainer.checkpoint]`: full checkpoints (the commit record of every step is separate)."""

    dir: str = ".flywheel/checkpoints"
    """Where checkpoints, the commit log and the pushed weights are written (shared with the
    engines: they load `weights/v_<version>/` from it)."""
    every: int = Field(10, ge=1)
    """Full checkpoints (model, AdamW, scheduler, RNG) every k committed steps and at a clean
    stop. Every step still makes a small durable commit record (`commits.jsonl`: its groups'
    stream entries, sample ids, RNG state); stream entries are acked only once a checkpoint
    covers them, so after a crash the trainer restores the newest checkpoint and trains the
    steps after it again from their records, in the same order and groups."""
    idle_s: float = Field(10.0, gt=0)
    """Also checkpoint the committed steps not yet covered when no step was committed for this
    many seconds, so their stream entries are acked while traffic pauses."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    save_optimizer: bool = True
    """Write AdamW, scheduler and RNG state with each checkpoint, so a resume continues the
    exact update (AdamW moments of the very step the weights are from). AdamW state is twice
    the fp32 model: measured for SmolLM2-135M, model.safetensors 513 MiB (about 2 s) and
    training/optimizer.pt 1026 MiB (4-12 s on a loaded 2-core machine's disk). Only the newest
    checkpoint keeps optimizer state (older ones are pruned to model + small state), so the disk
    holds keep x 513 MiB + 1026 MiB. Off: checkpoints are model-only and a resume restarts AdamW
    from zero moments (logged). Either way a resume neither loses nor retrains a sample: that
    guarantee rests on trainer_state.json and the commit log, not on AdamW state."""


class PushSettings(Section):
    """`[trainer.push]`: weight pushes to the engines."""

    engine_urls: list[str] = Field(default_factory=list)
    """Engines to push weights to; empty = the local engine."""
    every: int = Field(1, ge=1)
    """Push weights to the engines every k committed steps."""
    mode: Literal["disk", "distributed"] = "disk"
    """disk = /update_weights_from_disk of the exported weights; distributed = broadcast over a
    weight-update group with the engines (gloo on CPU, NCCL on GPU), disk as fallback."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the weights written for `/update_weights_from_disk`; auto = `engine.dtype`."""
    delta: bool | Literal["auto"] = "auto"
    """Delta pushes (disk mode): after the first push, write only the elements that changed
    since the last pushed version (`delta.safetensors`, checked by the engine with per-tensor
    checksums) and fall back to the full weights for an engine that serves another version,
    refuses it, or has no `/update_weights_from_delta` (SGLang), counted in
    `flywheel_trainer_weight_delta_fallbacks_total`. auto = on when the push dtype is bfloat16
    (about 1-3% of the elements change per step), off for float32, where nearly all change and
    a delta is as large as the full weights (bench/README.md, "Delta pushes")."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for one engine's /update_weights_from_disk answer."""
    attempts: int = Field(5, ge=1)
    """Attempts per engine (exponential backoff) before the weight push fails the trainer."""
    pause: Literal["none", "in_place", "abort"] = "none"
    """How a busy engine takes a disk push. none = a plain `/update_weights_from_disk`: the
    embedded engine swaps between two decode steps (`engine.weight_swap = "step"`, nothing
    waits); an engine that drains (SGLang, or `weight_swap = "drain"`) lets the rows in flight
    finish on the old weights first and requests that arrive meanwhile wait for them.
    in_place = `/pause_generation` in place, the update, `/continue_generation`: the rows in
    flight continue under the new weights from the swap on (their later tokens carry the new
    version, reported as `weight_versions` spans), and new requests wait only for the load
    (`bench/push_stall.py`). abort = `/pause_generation` in abort mode, the update,
    `/continue_generation` (SGLang's RL flow): the rows in flight end with their partial output
    and the gateway continues each from its tokens under the new weights (partial rollouts,
    `gateway/engines/partial.py`), so no row waits for the others. An engine without the pause
    mode (SGLang < 0.5.12) is updated the plain way (logged)."""
    master_address: str = "127.0.0.1"
    """Address the engines reach the trainer at for the distributed weight-update group (the
    rendezvous listens on every interface; deploy/k8s sets the trainer pod's IP)."""
    master_port: int = Field(0, ge=0, le=65535)
    """TCP port of that group's rendezvous on the trainer; 0 = a free port each time the group
    forms. Fix it where a firewall or NetworkPolicy must let it through (deploy/k8s: 29600)."""
    tp_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """TP ranks of each configured engine (`engine_urls`, else the configured ones), in that
    order (SGLang's `--tp-size`): engine i joins the group at rank 1 + the sum of the sizes
    before it, and the group has 1 + their sum ranks. Empty = ask each engine's `/server_info`
    (`tp_size`) before each push, as for every engine that joins the fleet (docs/fleet.md).
    Must have one entry per configured engine when given."""
    bucket_mb: float = Field(512.0, gt=0)
    """MiB of tensors per `/update_weights_from_distributed` call: a push sends the weights in
    buckets of this size (one call and one series of broadcasts each)."""


class DistributedSettings(Section):
    """`[trainer.distributed]`: training over several ranks (torchrun)."""

    strategy: Literal["all_reduce", "fsdp2"] = "all_reduce"
    """Under torchrun with more than one rank: all_reduce = every rank holds the whole model
    and gradients are summed with one all-reduce per parameter (the DDP update); fsdp2 =
    parameters, gradients and AdamW state sharded with FSDP2 `fully_shard`, checkpoints sharded
    per rank with torch.distributed.checkpoint (for models whose training state does not fit
    one device; CPU/gloo and CUDA/NCCL). fsdp2 refuses LoRA, push.mode = "distributed" and
    algorithm parts with their own forward."""


class LoraSettings(Section):
    """`[trainer.lora]`: LoRA adapters (peft) instead of full fine-tuning."""

    rank: int = Field(0, ge=0)
    """LoRA rank; 0 = full fine-tuning. Checkpoints hold the merged weights."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator (scale = alpha / rank)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names that get LoRA adapters."""


class LoggingSettings(Section):
    """`[trainer.logging]`: where per-step metrics go."""

    metrics_path: str = ".flywheel/trainer_metrics.jsonl"
    """JSONL file with one line of metrics per step (`timeline.jsonl` is written next to it)."""
    tensorboard: bool = True
    """Write per-step metrics as TensorBoard scalars to `<metrics_path folder>/tensorboard`."""
    wandb_project: str = ""
    """Also log metrics to this Weights & Biases project when wandb is installed; empty = off."""


MOVED: dict[str, str] = {
    **{k: f"optim.{k}" for k in OptimSettings.model_fields},
    **{k: f"batch.{k}" for k in BatchSettings.model_fields if k != "layout"},
    "batch_layout": "batch.layout",
    **{k: f"algorithm.{k}" for k in AlgorithmSettings.model_fields if k != "params"},
    "algorithm_params": "algorithm.params",
    "quantile_k": "algorithm.params.quantile.k",
    "max_staleness": "staleness.max_staleness",
    "stale_policy": "staleness.policy",
    "stale_decay": "staleness.decay",
    "stale_hard_limit": "staleness.hard_limit",
    **{k: f"data.{k}" for k in DataSettings.model_fields},
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "checkpoint_idle_s": "checkpoint.idle_s",
    "keep_checkpoints": "checkpoint.keep",
    "save_optimizer": "checkpoint.save_optimizer",
    "engine_urls": "push.engine_urls",
    "push_every": "push.every",
    "push_mode": "push.mode",
    "push_dtype": "push.dtype",
    "push_timeout_s": "push.timeout_s",
    "push_attempts": "push.attempts",
    "push_pause": "push.pause",
    "push_master_address": "push.master_address",
    "distributed_strategy": "distributed.strategy",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_target_modules": "lora.target_modules",
    **{k: f"logging.{k}" for k in LoggingSettings.model_fields},
}
"""Keys of the old flat `[trainer]` section -> where they live now (under `trainer.`)."""


class TrainerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    """HTTP port of /healthz, /metrics and /status."""
    model_path: str = ""
    """Initial policy folder; empty = the engine's model."""
    device: str = "auto"
    """torch device of the policy (`cpu`, `cuda`, `cuda:1`); auto = cuda when available."""
    precision: Literal["auto", "fp32", "bf16_autocast"] = "auto"
    """fp32 everywhere, or the decoder under bf16 autocast (fp32 master weights, fp32 AdamW
    state; the lm head and logprobs stay fp32). auto = bf16_autocast on CUDA with bf16
    support, else fp32 (on a CPU fp32 keeps the trainer's logprobs equal to the fp32 engine's:
    a mean abs diff about 1e-5 against about 0.02 nats under autocast); the choice and its
    reason are logged at start. On a CPU without native bf16 (e.g. AVX2 only) bf16 matmuls
    are emulated: measured 4.7x slower than fp32 per matmul and 2.7x per trainer step, so an
    explicit bf16_autocast there logs a warning."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward (less memory, about 30% slower). It turns the
    KV cache off in training, so the default `batch.layout` (shared_prefix) becomes padded, and
    an explicit shared_prefix is refused."""
    threads: int = Field(0, ge=0)
    """torch CPU threads of the trainer; 0 = torch's default (every core). On a CPU machine that
    also runs the engine, giving each its share of the cores (`engine.threads`) keeps them from
    slowing each other down when rollouts and training overlap."""
    seed: int = 0
    max_steps: int = Field(0, ge=0)
    """Optimizer steps after which the trainer exits; 0 = run until stopped."""
    consumer_name: str = ""
    """Consumer name in the `trainer` group; empty = host-pid."""
    background_io: bool = True
    """Checkpoint writes and weight pushes run in background threads from CPU snapshots while
    the next step trains (a push never overlaps the previous one: newer weights wait, and a
    version not yet started when a newer one arrives is skipped). False = both run on the
    step's critical path, as a synchronous loop does (for comparison; `bench/async_loop.py`)."""

    optim: OptimSettings = Field(default_factory=OptimSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    staleness: StalenessSettings = Field(default_factory=StalenessSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    push: PushSettings = Field(default_factory=PushSettings)
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [
                f"trainer.{key} moved to trainer.{MOVED[key]} (FLYWHEEL_TRAINER__"
                f"{MOVED[key].replace('.', '__').upper()})"
                for key in data
                if key in MOVED and key not in cls.model_fields
            ]
            if moved:
                raise ValueError(
                    "; ".join(moved) + " (the [trainer] section is nested by concern: "
                    "docs/architecture.md#trainer-settings)"
                )
        return data

    @model_validator(mode="after")
    def _possible_groups(self) -> TrainerSettings:
        from flywheel.core.algorithm_catalog import group_relative_advantages  # noqa: PLC0415

        advantage = self.algorithm.advantage
        if self.batch.group_size == 1 and advantage in group_relative_advantages():
            raise ValueError(
                f"trainer.batch.group_size = 1 with the group-relative advantage {advantage!r}: "
                "every group has one sample, so every advantage is 0; set "
                "trainer.batch.group_size >= 2, or an advantage that needs no group "
                '(trainer.algorithm.advantage = "opd")'
            )
        return self

    @model_validator(mode="after")
    def _layout_with_checkpointing(self) -> TrainerSettings:
        """Gradient checkpointing turns the decoder's KV cache off in training (transformers
        drops it per layer: a recomputed layer would append to it twice), and the shared-prefix
        layout runs each suffix on its prompt's cache. The default layout gives way to padded
        (same loss and gradients); an explicit shared_prefix is refused."""
        if not self.gradient_checkpointing or self.batch.layout != "shared_prefix":
            return self
        if "layout" in self.batch.model_fields_set:
            raise ValueError(
                'trainer.batch.layout = "shared_prefix" runs each suffix on its prompt\'s KV '
                "cache, which trainer.gradient_checkpointing = true turns off: set "
                'trainer.batch.layout = "padded" or "packed", or gradient_checkpointing = false'
            )
        self.batch.layout = "padded"
        return self
