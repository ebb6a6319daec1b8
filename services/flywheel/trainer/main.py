"""`python -m flywheel.trainer [--config FILE]`: the online RL trainer.

Parses settings (TOML file and/or `FLYWHEEL_TRAINER__*` environment variables), logs them
resolved, serves /healthz, /readyz, /status and /metrics on `trainer.host:trainer.port`, loads
or resumes the policy, then runs the loop in `service.py` until SIGTERM/SIGINT or
`trainer.max_steps` steps. A signal abandons the step in progress (abandon.py) and the
checkpoint of the last committed step is written at once. torch and transformers are imported
only after the settings parse.

Under `torchrun --nproc_per_node N -m flywheel.trainer`, rank 0 does all of the above and the
other ranks only train the batches it broadcasts (distributed.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from flywheel.core.settings import load_settings_or_exit

log = logging.getLogger("flywheel.trainer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flywheel.trainer", description=__doc__)
    parser.add_argument(
        "--config", default=None, help="TOML settings file (default: $FLYWHEEL_CONFIG, if set)"
    )
    parser.add_argument(
        "--check-settings",
        action="store_true",
        help="check the algorithm settings (parts, their parameters, inputs) and exit: 0 = valid",
    )
    return parser.parse_args(argv)


def settings_problem(settings: Any) -> str | None:
    """Why the trainer cannot run with `settings` (the selected algorithm parts, their
    `trainer.algorithm.params`, the inputs they need), or None. Needs torch, not the model."""
    from flywheel.trainer.policy import check_teacher_inputs  # noqa: PLC0415
    from flywheel.trainer.step import StepConfig  # noqa: PLC0415

    try:
        StepConfig.from_settings(settings.trainer)
        check_teacher_inputs(settings)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = load_settings_or_exit(args.config, "flywheel-trainer")
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("resolved settings: %s", settings.dump())
    from flywheel.core.cpu_libs import without_triton  # noqa: PLC0415

    # before settings_problem, whose imports (trainer.policy, trainer.step) reach torch._dynamo:
    # on a CPU its probe would load libtriton (75 MiB)
    without_triton()
    problem = settings_problem(settings)
    if problem is not None:
        print(f"flywheel-trainer: invalid [trainer] settings: {problem}", file=sys.stderr)
        return 2
    if args.check_settings:
        return 0

    from flywheel.core.heap import return_freed_tensors  # noqa: PLC0415

    return_freed_tensors()  # before the model loads: freed snapshots and gradients go back
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 (after settings)

    from flywheel.trainer.http import create_app, serve_in_thread  # noqa: PLC0415
    from flywheel.trainer.service import build_trainer  # noqa: PLC0415
    from flywheel.trainer.telemetry import TrainerStatus  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    if settings.trainer.threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(settings.trainer.threads)
    from flywheel.trainer.distributed import (  # noqa: PLC0415
        close_world,
        exit_distributed,
        init_world,
    )

    world = init_world()
    if world is not None and not world.main:
        from flywheel.trainer.policy import run_follower  # noqa: PLC0415

        try:
            steps = run_follower(settings, world)
            log.info("rank %d stopped after %d steps", world.rank, steps)
        finally:
            close_world(world)
        exit_distributed(0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    status = TrainerStatus()
    server = serve_in_thread(create_app(status), settings.trainer.host, settings.trainer.port)
    log.info("trainer HTTP on http://%s:%d", settings.trainer.host, settings.trainer.port)
    trainer = build_trainer(settings, status=status, world=world, stop=stop)
    try:
        steps = trainer.run(stop)
        log.info("trainer stopped after %d steps at weight version %d", steps, trainer.version)
    finally:
        trainer.close()
        server.should_exit = True
        close_world(world)
    if world is not None:
        exit_distributed(0)
    return 0
