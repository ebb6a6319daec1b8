"""TRL's GRPOTrainer on the demo's task, with the demo's settings, for a side-by-side run.

    bench/peers/setup_trl.sh
    ~/.cache/flywheel/peers/trl/bin/python bench/peers/trl_grpo.py --steps 30 --out runs/trl

Same model (the converted SmolLM2-135M-Instruct folder in ~/.cache/flywheel/models), same
problems and held-out split (flywheel.ops.demo.tasks, imported from the source tree), same reward
(1 when the last integer of the reply is the sum), group size 8 x 4 problems per step, one
optimizer step per batch of 32 rollouts (num_iterations=1), AdamW at the same lr, PPO clip 0.2,
no KL (beta=0), token-mean loss (TRL's "dapo" normalization), temperature 1.0, 32 new tokens,
fp32 on CPU. Prints the demo's summary line: reward first5/last5, greedy held-out accuracy
before/after, steps, minutes; summary.json also keeps the per-step reward curve and the unix
time each step's rewards were known (`reward_times`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "services"))

from flywheel.ops.demo.tasks import split, training_batches  # noqa: E402

REWARD_TIMES: list[float] = []
"""Unix time of each call of the reward function: one call per optimizer step (one generation
batch of 32 rollouts), so entry k is when step k's rewards were known."""


def last_integer_reward(completions, answer, **_):
    """1.0 when the last integer of the reply equals the answer, else 0.0 (the demo's verifier)."""
    REWARD_TIMES.append(time.time())
    return [
        score(completion[-1]["content"] if isinstance(completion, list) else completion, ans)
        for completion, ans in zip(completions, answer, strict=True)
    ]


def score(text: str, answer: int | str) -> float:
    found = re.findall(r"-?\d+", text)
    return 1.0 if found and int(found[-1]) == int(answer) else 0.0


def accuracy(model, tokenizer, problems) -> float:
    import torch  # noqa: PLC0415

    hits = 0
    for p in problems:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=32, do_sample=False)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += score(text, p.answer)
    return hits / len(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=str(Path.home() / ".cache/flywheel/models" / "SmolLM2-135M-Instruct")
    )
    parser.add_argument("--out", default="runs/trl")
    args = parser.parse_args()

    import torch  # noqa: PLC0415
    from datasets import Dataset  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
    from trl import GRPOConfig, GRPOTrainer  # noqa: PLC0415

    started = time.monotonic()
    model_dir = Path(args.model)  # converted by `make setup` / `flywheel demo`
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _, held_out = split()
    eval_before = accuracy(model, tokenizer, held_out)

    batches = training_batches(args.seed, args.problems_per_step)
    rows = [p for _ in range(args.steps) for p in next(batches)]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.question}], "answer": p.answer} for p in rows]
    )
    rollouts = args.problems_per_step * args.group_size
    cfg = GRPOConfig(
        output_dir=args.out,
        learning_rate=args.lr,
        num_generations=args.group_size,
        per_device_train_batch_size=rollouts,
        gradient_accumulation_steps=1,
        generation_batch_size=rollouts,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=32,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        max_grad_norm=1.0,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        gradient_checkpointing=False,  # TRL turns it on by default; Flywheel's trainer does not
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=cfg,
        reward_funcs=[last_integer_reward],
        train_dataset=data,
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    reward_times = list(REWARD_TIMES)
    eval_after = accuracy(trainer.model, tokenizer, held_out)
    minutes = (time.monotonic() - started) / 60
    first5 = sum(rewards[:5]) / max(len(rewards[:5]), 1)
    last5 = sum(rewards[-5:]) / max(len(rewards[-5:]), 1)
    summary = {
        "first5": first5,
        "last5": last5,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "steps": len(rewards),
        "minutes": minutes,
        "rewards": rewards,
        "reward_times": reward_times,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"reward first5={first5:.3f} last5={last5:.3f} eval_before={eval_before:.3f} "
        f"eval_after={eval_after:.3f} steps={len(rewards)} minutes={minutes:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
