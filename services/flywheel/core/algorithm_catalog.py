"""The trainer's algorithm parts as data: what `flywheel algorithms list` prints (every registered
part, its kind, paper and inputs) and the part names settings validation accepts. Lives in core
because the settings (core) and the operator's CLI read it; the parts themselves are the
trainer's (flywheel.trainer.algorithms).

Torch-free on purpose (the CLI imports it without loading torch). One row per registry entry;
`tests/unit/trainer/test_catalog.py` checks that rows and registries match both ways. `inputs`
is the declared input contract: the tensors the part reads from the step, so the step computes
extra model outputs (teacher logprobs, reference logprobs, entropy) only when a selected part
names them.

Kinds follow the design notes: advantage, weight (token weights / masks, incl. train-inference
corrections), ratio (policy loss: ratio form and clip), aggregation, regularizer.

Which `[trainer]` setting selects a part follows from its registry: ADVANTAGES -> `advantage`,
POLICY_LOSSES -> `policy_loss`, AGGREGATIONS -> `loss_aggregation`, CORRECTIONS ->
`rollout_correction`, WEIGHTS -> `token_weights` (a list, applied in order; includes the
`balanced` aggregation, which is a weighting for `token_mean`), KL_ESTIMATORS and TERMS ->
`regularizers` ({name = coefficient}; includes the SimKO and Lp-Reg weightings, which add a term
to the loss), REGULARIZERS -> `entropy_coef`. Per-part parameters: `[trainer.algorithm.params.
<name>]`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    name: str
    """Registry key (the value of the matching TrainerSettings field)."""
    kind: str
    """advantage | weight | ratio | aggregation | regularizer."""
    registry: str
    """Name of the registry dict that holds it (`ADVANTAGES`, `POLICY_LOSSES`, ...)."""
    paper: str
    """Short citation: method name, short title (the part before the colon) and arXiv id, or
    why there is none (a blog post); the part's docstring has the full title."""
    inputs: str
    """Comma-separated inputs it reads."""
    group_relative: bool = False
    """An advantage estimator whose advantage of a sample depends on the other members of its
    group (a group baseline or normalization): with one sample per group it has no reward
    signal, so `group_size = 1` is refused with it."""


CATALOG: tuple[Algorithm, ...] = (
    Algorithm(
        "grpo",
        "advantage",
        "ADVANTAGES",
        'GRPO, "DeepSeekMath", arXiv:2402.03300',
        "rewards_B, group_index_B",
        group_relative=True,
    ),
    Algorithm(
        "dr_grpo",
        "advantage",
        "ADVANTAGES",
        'Dr. GRPO, "Understanding R1-Zero-Like Training", arXiv:2503.20783',
        "rewards_B, group_index_B",
        group_relative=True,
    ),
    Algorithm(
        "rloo",
        "advantage",
        "ADVANTAGES",
        'RLOO, "Back to Basics: Revisiting REINFORCE Style Optimization", arXiv:2402.14740',
        "rewards_B, group_index_B",
        group_relative=True,
    ),
    Algorithm(
        "quantile",
        "advantage",
        "ADVANTAGES",
        'QAE, "Quantile Advantage Estimation for Entropy-Safe Reasoning", arXiv:2509.22611',
        "rewards_B, group_index_B",
        group_relative=True,
    ),
    Algorithm(
        "opd",
        "advantage",
        "ADVANTAGES",
        'GKD, "On-Policy Distillation of Language Models", arXiv:2306.13649',
        "teacher_logprobs_BT, rollout_logprobs_BT, teacher_mask_BT",
    ),
    Algorithm(
        "opd_plus_rl",
        "advantage",
        "ADVANTAGES",
        'OpenClaw-RL, "Train Any Agent Simply by Talking", arXiv:2603.10165',
        "rewards_B, group_index_B, teacher_logprobs_BT, rollout_logprobs_BT, teacher_mask_BT",
        group_relative=True,
    ),
    Algorithm(
        "tempo",
        "advantage",
        "ADVANTAGES",
        'TEMPO, "Exploiting Tree Structure for Credit Assignment in RL Training '
        'of LLMs", arXiv:2509.18314',
        "rewards_B, group_index_B, token_ids_BT, loss_mask_BT",
        group_relative=True,
    ),
    Algorithm(
        "ktae",
        "advantage",
        "ADVANTAGES",
        'KTAE, "A Model-Free Algorithm to Key-Tokens Advantage Estimation", arXiv:2505.16826',
        "rewards_B, group_index_B, token_ids_BT, loss_mask_BT",
        group_relative=True,
    ),
    Algorithm(
        "zero_variance",
        "advantage",
        "ADVANTAGES",
        'RL-ZVP, "No Prompt Left Behind", arXiv:2509.21880',
        "rewards_B, group_index_B, loss_mask_BT, entropy_BT",
        group_relative=True,
    ),
    Algorithm(
        "miner",
        "advantage",
        "ADVANTAGES",
        'Miner, "Mining Intrinsic Mastery for Data-Efficient RL", arXiv:2601.04731',
        "rewards_B, group_index_B, loss_mask_BT, rollout_logprobs_BT",
        group_relative=True,
    ),
    Algorithm(
        "a3po",
        "advantage",
        "ADVANTAGES",
        'A3PO, "Rethinking Sample Polarity in RLVR", arXiv:2512.21625',
        "rewards_B, group_index_B, loss_mask_BT, rollout_logprobs_BT",
        group_relative=True,
    ),
    Algorithm(
        "turn_level",
        "advantage",
        "ADVANTAGES",
        'Turn-PPO arXiv:2512.17008; StepPO, "Step-Aligned Policy Optimization", arXiv:2604.18401',
        "rewards_B, group_index_B, turn_index_B",
        group_relative=True,
    ),
    Algorithm(
        "segment",
        "advantage",
        "ADVANTAGES",
        "DeepSeekMath process supervision arXiv:2402.03300; CAPO "
        "arXiv:2508.02298; SPAE arXiv:2601.03823; MA-RLHF arXiv:2410.02743",
        "rewards_B, group_index_B, loss_mask_BT, step_rewards_BT",
        group_relative=True,
    ),
    Algorithm(
        "rlsd",
        "advantage",
        "ADVANTAGES",
        'RLSD, "Self-Distilled RLVR", arXiv:2604.03128',
        "rewards_B, group_index_B, loss_mask_BT, teacher_logprobs_BT, rollout_logprobs_BT",
        group_relative=True,
    ),
    Algorithm(
        "sdar_gate",
        "advantage",
        "ADVANTAGES",
        'SDAR, "Self-Distilled Agentic Reinforcement Learning", arXiv:2605.15155',
        "rewards_B, group_index_B, loss_mask_BT, teacher_logprobs_BT, rollout_logprobs_BT",
        group_relative=True,
    ),
    Algorithm(
        "contrastive_sd",
        "advantage",
        "ADVANTAGES",
        'RLCSD, "Contrastive On-Policy Self-Distillation", arXiv:2606.11709',
        "rewards_B, group_index_B, loss_mask_BT, teacher_logprobs_BT, "
        "rollout_logprobs_BT, wrong_hint_logprobs_BT",
        group_relative=True,
    ),
    Algorithm(
        "high_entropy_only",
        "weight",
        "WEIGHTS",
        '"Beyond the 80/20 Rule" (forking tokens), arXiv:2506.01939',
        "advantages_BT, loss_mask_BT, entropy_BT",
    ),
    Algorithm(
        "entropy_gate",
        "weight",
        "WEIGHTS",
        'EGSPO, "Entropy-Gated Selective Policy Optimization", arXiv:2602.03309',
        "advantages_BT, loss_mask_BT, entropy_BT",
    ),
    Algorithm(
        "entropy_weighted",
        "weight",
        "WEIGHTS",
        '"GTPO and GRPO-S", arXiv:2508.04349',
        "advantages_BT, loss_mask_BT, entropy_BT",
    ),
    Algorithm(
        "surprisal_reweight",
        "weight",
        "WEIGHTS",
        'STARE, "Surprisal-Guided Token-Level Advantage Reweighting", arXiv:2606.19236',
        "advantages_BT, loss_mask_BT, old_logprobs_BT, entropy_BT",
    ),
    Algorithm(
        "entropy_change",
        "weight",
        "WEIGHTS",
        'STEER, "Rethinking Entropy Interventions in RLVR", arXiv:2510.10150; arXiv:2505.22617',
        "advantages_BT, loss_mask_BT, old_logprobs_BT, entropy_BT",
    ),
    Algorithm(
        "uncertainty_shaping",
        "weight",
        "WEIGHTS",
        'UCAS, "Uncertainty-aware Advantage Shaping", arXiv:2510.10649',
        "advantages_BT, loss_mask_BT, old_logprobs_BT",
    ),
    Algorithm(
        "d3s",
        "weight",
        "WEIGHTS",
        'D^3S, "Learning More with Less", arXiv:2509.22115',
        "advantages_BT, loss_mask_BT, group_index_B, entropy_BT, step",
    ),
    Algorithm(
        "nat",
        "weight",
        "WEIGHTS",
        'NAT, "Not All Tokens Are Needed": URS, RPC, arXiv:2603.06619',
        "advantages_BT, loss_mask_BT, step",
    ),
    Algorithm(
        "prefix_focus",
        "weight",
        "WEIGHTS",
        'PPPO, "Well Begun, Half Done", arXiv:2512.15274',
        "advantages_BT, loss_mask_BT, step",
    ),
    Algorithm(
        "delta_logp",
        "weight",
        "WEIGHTS",
        '"On the Direction of RLVR Updates for LLM Reasoning", arXiv:2603.22117',
        "advantages_BT, loss_mask_BT, old_logprobs_BT",
    ),
    Algorithm(
        "balanced",
        "aggregation",
        "WEIGHTS",
        'BA, "Balanced Aggregation", arXiv:2605.04077',
        "advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "ppo_clip",
        "ratio",
        "POLICY_LOSSES",
        "PPO arXiv:1707.06347; DAPO clip-higher arXiv:2503.14476; dual clip arXiv:1912.09729",
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "gspo",
        "ratio",
        "POLICY_LOSSES",
        'GSPO, "Group Sequence Policy Optimization", arXiv:2507.18071',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "cispo",
        "ratio",
        "POLICY_LOSSES",
        'CISPO, "MiniMax-M1", arXiv:2506.13585',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "dhpo",
        "ratio",
        "POLICY_LOSSES",
        'DHPO, "Orchestrating Tokens and Sequences", arXiv:2601.05607',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT, entropy_BT",
    ),
    Algorithm(
        "aspo",
        "ratio",
        "POLICY_LOSSES",
        'ASPO, "Asymmetric Importance Sampling Policy Optimization", arXiv:2510.06062',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "cppo",
        "ratio",
        "POLICY_LOSSES",
        'CPPO, "Beyond Uniform Token-Level Trust Region", arXiv:2606.10968',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "prefix_ratio",
        "ratio",
        "POLICY_LOSSES",
        'MinPRO, "A Step Back: Prefix Importance Ratio", arXiv:2601.22718',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "wapo",
        "ratio",
        "POLICY_LOSSES",
        'WAPO, "A Gradient Perspective on RLVR Stability", arXiv:2606.16154',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "seq_elbo_ratio",
        "ratio",
        "POLICY_LOSSES",
        'ESPO (AR form), "Principled RL for Diffusion LLMs", arXiv:2512.03759',
        "logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT",
    ),
    Algorithm(
        "token_mean",
        "aggregation",
        "AGGREGATIONS",
        'DAPO, "An Open-Source LLM RL System at Scale", arXiv:2503.14476',
        "token_loss_BT, loss_mask_BT",
    ),
    Algorithm(
        "seq_mean_token_mean",
        "aggregation",
        "AGGREGATIONS",
        'GRPO, "DeepSeekMath", arXiv:2402.03300',
        "token_loss_BT, loss_mask_BT",
    ),
    Algorithm(
        "seq_mean_token_sum",
        "aggregation",
        "AGGREGATIONS",
        'Dr. GRPO, "Understanding R1-Zero-Like Training", arXiv:2503.20783',
        "token_loss_BT, loss_mask_BT",
    ),
    Algorithm(
        "constant_normalizer",
        "aggregation",
        "AGGREGATIONS",
        'AsyncWebRL constant 1/k, "Efficient Multi-Step RL", arXiv:2606.05597',
        "token_loss_BT, loss_mask_BT",
    ),
    Algorithm("none", "weight", "CORRECTIONS", "no train-inference correction (no paper)", "-"),
    Algorithm(
        "tis",
        "weight",
        "CORRECTIONS",
        'TIS, "Your Efficient RL Framework Secretly Brings You Off-Policy RL '
        'Training" (blog, no arXiv id)',
        "train_logprobs_BT, rollout_logprobs_BT, loss_mask_BT",
    ),
    Algorithm(
        "mis",
        "weight",
        "CORRECTIONS",
        'MIS, "When Speed Kills Stability" (blog, no arXiv id)',
        "train_logprobs_BT, rollout_logprobs_BT, loss_mask_BT",
    ),
    Algorithm(
        "icepop",
        "weight",
        "CORRECTIONS",
        'IcePop, "Every Step Evolves" (Ring-1T), arXiv:2510.18855',
        "train_logprobs_BT, rollout_logprobs_BT, loss_mask_BT",
    ),
    Algorithm(
        "k1",
        "regularizer",
        "KL_ESTIMATORS",
        'Schulman, "Approximating KL Divergence" (blog, no arXiv id)',
        "logprobs_BT, ref_logprobs_BT",
    ),
    Algorithm(
        "k2",
        "regularizer",
        "KL_ESTIMATORS",
        'Schulman, "Approximating KL Divergence" (blog, no arXiv id)',
        "logprobs_BT, ref_logprobs_BT",
    ),
    Algorithm(
        "k3",
        "regularizer",
        "KL_ESTIMATORS",
        'Schulman, "Approximating KL Divergence" (blog, no arXiv id); GRPO arXiv:2402.03300',
        "logprobs_BT, ref_logprobs_BT",
    ),
    Algorithm(
        "entropy_bonus",
        "regularizer",
        "REGULARIZERS",
        "PPO entropy bonus, arXiv:1707.06347 (trainer.algorithm.entropy_coef)",
        "entropy_BT (with grad)",
    ),
    Algorithm(
        "entropy_bonus_sampled",
        "regularizer",
        "TERMS",
        "PPO entropy bonus (sampled-token estimator), arXiv:1707.06347",
        "logprobs_BT",
    ),
    Algorithm(
        "entropy_min",
        "regularizer",
        "TERMS",
        'EM-RL, "The Unreasonable Effectiveness of Entropy Minimization", arXiv:2505.15134',
        "logprobs_BT",
    ),
    Algorithm(
        "distill_rkl",
        "regularizer",
        "TERMS",
        'GKD, "On-Policy Distillation of Language Models", arXiv:2306.13649',
        "logprobs_BT, teacher_logprobs_BT",
    ),
    Algorithm(
        "distill_fkl",
        "regularizer",
        "TERMS",
        'forward KL, "Decoupling KL and Trajectories", arXiv:2605.16826',
        "logprobs_BT, teacher_logprobs_BT",
    ),
    Algorithm(
        "distill_mixed",
        "regularizer",
        "TERMS",
        'KL mixing, "Decoupling KL and Trajectories", arXiv:2605.16826',
        "logprobs_BT, teacher_logprobs_BT",
    ),
    Algorithm(
        "distill_topk",
        "regularizer",
        "TERMS",
        "top-k + tail bin: OpenClaw-RL arXiv:2603.10165; KL study arXiv:2605.16826",
        "teacher_topk_logprobs_BTK, student_logprobs_at_teacher_topk_BTK",
    ),
    Algorithm(
        "grsp",
        "regularizer",
        "TERMS",
        'GRSP, "Mitigating Overthinking through Reasoning Shaping", arXiv:2510.09535',
        "logprobs_BT, loss_mask_BT, group_index_B",
    ),
    Algorithm(
        "simko",
        "weight",
        "TERMS",
        'SimKO, "Simple Pass@K Policy Optimization", arXiv:2510.14807',
        "logprobs_BT, advantages_BT, loss_mask_BT, entropy_BT, student_topk_logprobs_BTK",
    ),
    Algorithm(
        "lp_reg",
        "weight",
        "TERMS",
        'Lp-Reg, "Low-probability Tokens Sustain Exploration", arXiv:2510.03222',
        "logprobs_BT, advantages_BT, loss_mask_BT, student_topk_logprobs_BTK",
    ),
)
"""Every registered part, in registry order."""

KINDS = ("advantage", "weight", "ratio", "aggregation", "regularizer")


def format_table(rows: tuple[Algorithm, ...] = CATALOG) -> str:
    """Plain-text table with the columns name, kind, paper, inputs (no trailing spaces)."""
    header = ("name", "kind", "paper", "inputs")
    cells = [header] + [(r.name, r.kind, r.paper, r.inputs) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = []
    for c in cells:
        lines.append("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3])
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    return "\n".join(lines)


_FIELD_REGISTRIES = {
    "advantage": ("ADVANTAGES",),
    "policy_loss": ("POLICY_LOSSES",),
    "loss_aggregation": ("AGGREGATIONS",),
    "rollout_correction": ("CORRECTIONS",),
    "token_weights": ("WEIGHTS",),
    "regularizers": ("KL_ESTIMATORS", "TERMS"),
}


def group_relative_advantages() -> set[str]:
    """Advantage estimators that need groups of at least two samples (`group_relative`)."""
    return {row.name for row in CATALOG if row.group_relative}


def names_for(settings_field: str) -> set[str]:
    """Part names a `TrainerSettings` field accepts (`params`: any part name)."""
    if settings_field == "params":
        return {row.name for row in CATALOG}
    registries = _FIELD_REGISTRIES[settings_field]
    return {row.name for row in CATALOG if row.registry in registries}
