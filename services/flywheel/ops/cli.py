"""The `flywheel` command: `up`, `down`, `demo`, `status`, `check-fidelity`, `config show`,
`keys`, `engines`, `algorithms list`.

`flywheel up [--config FILE]` starts the local stack and waits for Ctrl-C; `flywheel down`
stops it. Both use the settings' state dir (`state_dir`, env FLYWHEEL_STATE_DIR; default
.flywheel).
`flywheel demo --steps N --out DIR [--task addition|agent] [--mode async|sync] [--max-staleness N]`
runs the training demo (agent: the tool-using one) on a running stack (started by `flywheel up`
in the same state dir), or on a new one that it starts and stops itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel.core.settings import FlywheelSettings, load_settings_or_exit
from flywheel.ops import engines_cli
from flywheel.ops.cli_parser import CliParser
from flywheel.ops.demo_cli import (
    add_demo_arguments,
    demo_folder,
    demo_options,
    missing_folders,
    out_problem,
    replace_stack_folder,
    stack_folder_note,
)
from flywheel.ops.down import cmd_down
from flywheel.ops.fidelity_cli import cmd_check_fidelity
from flywheel.ops.up import (
    START_FAILURES,
    cmd_up,
    interrupted_exit,
    moved_port_warnings,
    start_failed,
    stop_on_signals,
)

if TYPE_CHECKING:
    from flywheel.ops.demo.runner import DemoConfig
    from flywheel.ops.demo.runner import DemoRunner as DemoRunnerT


def _settings(args: argparse.Namespace) -> FlywheelSettings:
    return load_settings_or_exit(args.config)


def _positive_float(value: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value}")
    return number


def cmd_demo(args: argparse.Namespace) -> int:
    from flywheel.ops.demo.tasks_choice import demo_runner  # noqa: PLC0415

    started = time.monotonic()
    out = Path(args.out)
    try:
        DemoRunner, cfg = demo_runner(  # noqa: N806 (a class)
            args.task,
            steps=args.steps,
            problems_per_step=args.problems_per_step,
            group_size=args.group_size,
            seed=args.seed,
            mode=args.mode,
            max_staleness=args.max_staleness,
            eval_seed=args.eval_seed,
            eval_size=args.eval_size,
        )
    except ValueError as exc:  # a flag the task would not use
        print(f"flywheel demo: {exc}", file=sys.stderr)
        return 2
    settings = _settings(args)  # a bad setting is refused before --out is created
    created = missing_folders(out)
    if problem := out_problem(out):
        print(f"flywheel demo: --out {out} {problem}; pass another folder", file=sys.stderr)
        return 2
    with demo_folder(out, created) as refusal:  # held until the demo's stack has stopped
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
        return _demo_in(args, settings, out, DemoRunner, cfg, started)


def _demo_in(
    args: argparse.Namespace,
    settings: FlywheelSettings,
    out: Path,
    DemoRunner: type[DemoRunnerT],  # noqa: N803 (a class)
    cfg: DemoConfig,
    started: float,
) -> int:
    """`flywheel demo` in its `--out` folder, which it holds: on the running stack, or on a
    stack of its own that it starts in `<out>/stack` and stops."""
    from flywheel.ops.stack import Stack, running_stack  # noqa: PLC0415

    state = running_stack(settings.state_dir) if not args.new_stack else None
    if state:
        print(f"using the running stack at {state['gateway']}")
        trainer = _running_trainer_settings(settings)
        lead = 0 if cfg.mode == "sync" else cfg.max_staleness
        staleness = trainer.get("staleness", {})
        if staleness.get("max_staleness", lead) < lead:
            print(
                f"flywheel: the rollouts may lag {lead} weight versions (--max-staleness) but "
                "the running trainer's trainer.staleness.max_staleness is "
                f"{staleness['max_staleness']}: it applies its trainer.staleness.policy "
                f"({staleness.get('policy')}) to the older samples",
                file=sys.stderr,
            )
        if refusal := _batch_mismatch(trainer.get("batch", {}), cfg, args.task):
            print(refusal, file=sys.stderr)
            return 2
        timeline = Path(trainer["logging"]["metrics_path"]).parent / "timeline.jsonl"
        on_running = DemoRunner(
            state["gateway"],
            state["engine"],
            cfg,
            out,
            **demo_options(args, timeline, settings.state_dir),
        )
        if refusal := on_running.access_refusal():
            print(refusal, file=sys.stderr)
            return 2
        stop_on_signals()  # SIGTERM too ends the run with its summary
        try:
            return _run_demo(on_running, started)
        except KeyboardInterrupt as exc:  # the running stack is not the demo's: it goes on
            print("flywheel: demo interrupted; the running stack goes on", file=sys.stderr)
            return interrupted_exit(exc)
    stack_dir = out / "stack"
    replace_stack_folder(stack_dir)
    settings.state_dir = str(stack_dir)
    settings.trainer.checkpoint.dir = str(stack_dir / "checkpoints")
    settings.trainer.logging.metrics_path = str(out / "trainer_metrics.jsonl")
    settings.trainer.batch.groups_per_step = cfg.problems_per_step
    settings.trainer.batch.group_size = cfg.group_size
    settings.trainer.staleness.max_staleness = cfg.max_staleness
    if args.task == "agent" and "group_wait_s" not in settings.trainer.batch.model_fields_set:
        # Multi-turn episodes of one group end minutes apart on a busy CPU: a group trained
        # partial (after the default 120 s) would lose its baseline, so wait for all of it.
        settings.trainer.batch.group_wait_s = AGENT_GROUP_WAIT_S
    if cfg.mode == "async":
        _share_the_machine(settings)
    timeline = Path(settings.trainer.logging.metrics_path).parent / "timeline.jsonl"
    stack = Stack(settings, config_file=args.config)
    runner, interrupted = None, False
    stop_on_signals()
    try:  # stopped however the demo ends, also on Ctrl-C or SIGTERM during start-up
        try:
            stack.start()
        except START_FAILURES as exc:
            start_failed(stack, exc)
            return 1
        for line in moved_port_warnings(stack):  # as `flywheel up` warns
            print(line, flush=True)
        urls = {s.name: s.url for s in stack.services}
        runner = DemoRunner(
            urls["gateway"], urls["engine"], cfg, out, **demo_options(args, timeline, stack_dir)
        )
        if refusal := runner.access_refusal():
            print(refusal, file=sys.stderr)
            return 2
        return _run_demo(runner, started)
    except KeyboardInterrupt as exc:
        print("flywheel: demo interrupted; stopping its stack", file=sys.stderr)
        interrupted = True
        return interrupted_exit(exc)
    finally:
        stack.stop()
        if interrupted:  # what the stopped stack leaves on disk
            print(stack_folder_note(stack_dir), file=sys.stderr)
        if runner is not None:  # the trainer's stop checkpoint and last push are drawn too
            try:
                runner.draw_timeline()
            except Exception as exc:  # noqa: BLE001 (the demo's own outcome comes first)
                print(f"flywheel: timeline.png not redrawn: {exc}", file=sys.stderr)
            if not interrupted:  # what the demo's stack leaves on disk, as interrupted
                print(stack_folder_note(stack_dir))


AGENT_GROUP_WAIT_S = 3600.0
"""`trainer.batch.group_wait_s` on a stack `flywheel demo --task agent` starts (unless set)."""


def _batch_mismatch(batch: dict, cfg: DemoConfig, task: str) -> str | None:
    """The CLI message refusing a demo whose groups do not fill the running trainer's steps
    (`trainer.batch.group_size` rollouts per group, `groups_per_step` groups per step); None
    when they match. Such a demo would only fail after `step_timeout_s`: its steps never come.

    Example: batch {"group_size": 8, "groups_per_step": 4}, `--group-size 1` -> a message
    asking for `--group-size 8 --problems-per-step 4`, or a stack of the demo's own.
    """
    size, groups = batch.get("group_size"), batch.get("groups_per_step")
    if (size, groups) == (cfg.group_size, cfg.problems_per_step) or None in (size, groups):
        return None
    agent = " --task agent" if task == "agent" else ""
    return (
        "flywheel: the running trainer trains steps of trainer.batch.groups_per_step = "
        f"{groups} groups of trainer.batch.group_size = {size} rollouts, but this demo samples "
        f"{cfg.problems_per_step} groups (--problems-per-step) of {cfg.group_size} rollouts "
        "(--group-size) per step, so its steps would never be trained. Run "
        f"`flywheel demo{agent} --problems-per-step {groups} --group-size {size} ...` on this "
        "stack; or stop it (`flywheel down`) and start it again with [trainer.batch] "
        f"groups_per_step = {cfg.problems_per_step} and group_size = {cfg.group_size}; or add "
        "--new-stack to run the demo on a stack of its own"
    )


def _running_trainer_settings(settings: FlywheelSettings) -> dict:
    """The trainer settings a running local stack resolved (`<state_dir>/settings.json`, where
    its metrics file may have moved into the state dir); the configured ones when absent."""
    trainer = settings.trainer.model_dump(mode="json")
    try:
        resolved = json.loads((Path(settings.state_dir) / "settings.json").read_text())
        trainer |= resolved["trainer"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return trainer


def _run_demo(runner, started: float) -> int:  # noqa: ANN001
    """Run the demo and print where its files are. Interrupted: prints the step it reached
    and the files written so far (`DemoRunner.write_interrupted`), then raises again. A step
    whose every episode failed (`StepFailed`): says so and where its files are; returns 1."""
    from flywheel.ops.demo.runner import StepFailed  # noqa: PLC0415

    try:
        summary = runner.run(started_at=started)
    except KeyboardInterrupt:
        partial = runner.interrupted
        if partial is not None:
            print(
                f"\ninterrupted after step {partial['step_reached']} of {runner.cfg.steps}; "
                f"wrote {', '.join(partial['files'])}",
                flush=True,
            )
        raise
    except StepFailed as exc:  # every episode of a step failed: no version can come
        print(f"flywheel: {exc}", file=sys.stderr)
        print(f"wrote {', '.join(runner.interrupted['files'])}")
        return 1
    print(
        f"wrote {runner.out / 'metrics.jsonl'}, {runner.out / 'reward_curve.png'}, "
        f"{runner.out / 'timeline.png'} and {runner.out / 'summary.json'}"
    )
    print(learning_verdict(summary))
    return 0


def learning_verdict(summary: dict) -> str:
    """One line on whether the demo run learned: the training reward of the last 5 steps
    against the first 5 (only with 10+ steps: fewer share steps between the windows) and the
    held-out accuracy before against after ("n/a" for one not measured: every episode of that
    evaluation failed)."""
    before, after = summary["eval_before"], summary["eval_after"]
    shown = ["n/a" if v is None else f"{v:.3f}" for v in (before, after)]
    held_out = f"held-out accuracy {shown[0]} -> {shown[1]}"
    if summary.get("steps", 0) < 10:
        return (
            f"{held_out}; too few steps ({summary.get('steps', 0)}) to compare the first "
            "and last 5 steps' rewards: run 10 or more for that."
        )
    learned = (
        summary["last5"] > summary["first5"] and None not in (before, after) and after > before
    )
    return (
        f"the policy learned ({held_out})."
        if learned
        else f"no measurable learning in this run ({held_out})."
    )


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415

    from flywheel.ops.status import collect_status, render  # noqa: PLC0415
    from flywheel.ops.target import resolve  # noqa: PLC0415

    settings = _settings(args)
    # The local stack's actual addresses when `flywheel up` runs from this state dir; else the
    # configured ones (compose, a port-forwarded cluster, or another folder's stack), said so
    # on stderr and in the JSON's `source` (ops/target.py).
    target = resolve(settings, args.config)
    state = target.state
    if target.note():
        print(target.note(), file=sys.stderr)
    report = collect_status(settings, state)
    if args.json:
        print(json.dumps({"source": target.source, **report.to_json()}, indent=2))
    else:
        Console().print(render(report))
    return 0 if report.healthy else 1


NO_KEYS_LEFT = (
    "no agent or admin keys are left: the gateway keeps requiring keys, so it now refuses "
    "every request (401). Create one with `flywheel keys create --role admin`, or run "
    "`flywheel keys reopen` to serve loopback clients without keys again."
)


def cmd_keys(args: argparse.Namespace) -> int:
    """`flywheel keys create|list|mark|revoke|reopen`: API keys in the deployment's Redis (stored
    hashed); `--not-for-training` keys are served and never recorded (docs/security.md)."""
    from flywheel.core.auth import KeyStore  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.ops.target import resolve  # noqa: PLC0415

    settings = _settings(args)
    target = resolve(settings, args.config)
    if args.keys_command == "list":
        if target.note():
            print(target.note(), file=sys.stderr)
    else:
        target.refuse_change(
            {
                "create": "create an API key",
                "mark": "change an API key",
                "revoke": "revoke an API key",
                "reopen": "stop requiring API keys",
            }[args.keys_command]
        )
    url = target.redis_url
    store = KeyStore(connect(url), settings.streams.prefix)
    try:
        if args.keys_command == "create":
            secret, record = store.create(args.role, args.name, train=not args.not_for_training)
            use = "" if record.train else " (not for training)"
            print(f"created {record.role} key {record.key_id}{use}; it is shown only once:")
            print(secret)
        elif args.keys_command == "list":
            records = store.list()
            if records:  # the TRAIN column: whether the key's turns become training data
                print(f"{'KEY_ID':12}  {'ROLE':6}  {'TRAIN':8}  NAME")
            for r in records:
                use = "train" if r.train else "no-train"
                print(f"{r.key_id:12}  {r.role:6}  {use:8}  {r.name}")
            if not records:
                print("no API keys")
        elif args.keys_command == "mark":
            record = store.set_train(args.key_id, args.train)
            use = "for training" if record.train else "not for training"
            print(f"key {record.key_id} is now {use}")
        elif args.keys_command == "reopen":
            store.reopen()
            print(
                'no keys required again where gateway.security.auth = "auto" and the gateway '
                "binds loopback (within key_cache_s); anyone reaching it is served as admin"
            )
        else:
            print(f"revoked {store.revoke(args.key_id).key_id}")
            if not store.keys_left():
                print(NO_KEYS_LEFT)
    except Exception as exc:  # noqa: BLE001  (CLI edge: a message, not a traceback)
        sys.exit(f"flywheel: {exc} (Redis at {url.split('@')[-1]}; is the stack up?)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """Print the resolved settings; exit 1 with the trainer's message when it would refuse them.
    A `[trainer.algorithm]` other than the default is checked by the trainer's own code, as
    `flywheel up` does before it starts a service (parts' parameters, the inputs they need), so
    what `config show` prints is what `up` accepts; the default needs no check (and no torch)."""
    from flywheel.core.settings import mask_secrets  # noqa: PLC0415
    from flywheel.ops.stack import trainer_settings_problem  # noqa: PLC0415

    settings = _settings(args)
    algorithm = settings.trainer.algorithm
    default = algorithm == type(algorithm)()
    problem = None if default else trainer_settings_problem(os.environ, args.config)
    if problem is not None:
        print(f"flywheel: {problem}", file=sys.stderr)
        return 1
    data = mask_secrets(settings.model_dump(mode="json"))
    if args.format == "yaml":
        import yaml  # noqa: PLC0415

        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        print(json.dumps(data, indent=2))
    return 0


def cmd_algorithms_list(args: argparse.Namespace) -> int:
    from flywheel.core.algorithm_catalog import format_table  # noqa: PLC0415

    print(format_table())
    return 0


def _share_the_machine(settings: FlywheelSettings) -> None:
    """Settings for rollouts that run while the trainer trains (what the user left unset):
    engines take new weights paused in place, so rows in flight continue under them; and where
    engine and trainer share the CPU, each gets half of its cores, so they do not slow each
    other down (on 2 cores, sharing all of them gave 0.39x the steps per hour of the
    synchronous loop and splitting them 1.35x: `bench/async_loop.py`)."""
    if "pause" not in settings.trainer.push.model_fields_set:
        settings.trainer.push.pause = "in_place"
    auto = "auto" in (settings.engine.device, settings.trainer.device)
    cuda = auto and _cuda_available()
    on_cpu = settings.engine.device == "cpu" or (settings.engine.device == "auto" and not cuda)
    trainer_cpu = settings.trainer.device == "cpu" or (
        settings.trainer.device == "auto" and not cuda
    )
    half = max(1, (os.cpu_count() or 2) // 2)
    on_cpu = on_cpu and settings.engine.backend == "embedded"  # SGLang has no engine.threads
    if on_cpu and trainer_cpu and not settings.engine.threads and not settings.trainer.threads:
        settings.engine.threads = half
        settings.trainer.threads = half


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device, asked in a child process, so the demo's own process
    (alive for the whole run) never imports torch (about 220 MiB); False where the child
    cannot tell (no torch installed)."""
    probe = [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=300, check=True)
    except (subprocess.SubprocessError, OSError):
        return False
    return done.stdout.strip() == "1"


STATE_DIR_HELP = (
    "The stack's state (Redis data, checkpoints, logs, its running-stack file) is in the "
    "state dir: `state_dir` in the settings file, or env FLYWHEEL_STATE_DIR (default "
    ".flywheel, relative to the current directory)."
)
"""The state dir's line in `flywheel up --help` and `flywheel down --help`."""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="flywheel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common = CliParser(add_help=False)
    common.add_argument("--config", default=None, help="settings file (YAML, TOML or JSON)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "up",
        help="start the local stack",
        description="Start the local stack (Redis, engine, gateway, reward, trainer) and wait "
        f"for Ctrl-C. {STATE_DIR_HELP}",
        parents=[common],
    ).set_defaults(func=cmd_up)
    sub.add_parser(
        "down",
        help="stop the stack that runs from the state dir (flywheel up, or a demo's own)",
        description="Stop the stack that runs from the state dir (`flywheel up`'s, or the one "
        f"a demo started: its state dir is <demo --out>/stack). {STATE_DIR_HELP}",
        parents=[common],
    ).set_defaults(func=cmd_down)
    demo = sub.add_parser("demo", help="run the training demo", parents=[common])
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    status = sub.add_parser(
        "status",
        parents=[common],
        help="health, streams and lag, weight versions, trainer progress",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    fidelity = sub.add_parser(
        "check-fidelity",
        parents=[common],
        help="re-score a session's recorded Samples on the engine",
    )
    fidelity.add_argument("--session", required=True, help="session id")
    fidelity.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="largest |recorded - re-scored logprob| per token that passes (default 1e-4)",
    )
    fidelity.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds to wait for the engine to re-score one Sample (default 600)",
    )
    fidelity.set_defaults(func=cmd_check_fidelity)
    config = sub.add_parser("config", help="settings")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", parents=[common], help="print the resolved settings (secrets masked)"
    )
    show.add_argument(
        "--format", choices=["json", "yaml"], default="json", help="output format (default json)"
    )
    show.set_defaults(func=cmd_config_show)
    keys = sub.add_parser("keys", help="gateway API keys (agent, admin)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="mint a key (printed once)", parents=[common])
    create.add_argument(
        "--role",
        choices=["agent", "admin"],
        default="agent",
        help="agent: the model and session routes; admin: also the control routes "
        "(/v1/admin/..., the dashboard) (default agent)",
    )
    create.add_argument("--name", default="", help="a label shown by `keys list` (default none)")
    create.add_argument(
        "--not-for-training",
        action="store_true",
        help="the key's requests are served and never recorded",
    )
    keys_sub.add_parser("list", help="key ids, roles, training use and names", parents=[common])
    mark = keys_sub.add_parser(
        "mark", help="mark a key for training or not (by id)", parents=[common]
    )
    mark.add_argument("key_id", help="the key's id (`flywheel keys list`)")
    use = mark.add_mutually_exclusive_group(required=True)
    use.add_argument("--train", dest="train", action="store_true", help="record its turns")
    use.add_argument(
        "--not-for-training", dest="train", action="store_false", help="never record its turns"
    )
    revoke = keys_sub.add_parser("revoke", help="delete a key by id", parents=[common])
    revoke.add_argument("key_id", help="the key's id (`flywheel keys list`)")
    keys_sub.add_parser(
        "reopen",
        help="after the last key was revoked: serve loopback clients without keys again "
        "(auth = auto)",
        parents=[common],
    )
    keys.set_defaults(func=cmd_keys)
    engines_cli.install(sub, common)  # flywheel engines list|add|remove (the fleet)
    algorithms = sub.add_parser("algorithms", help="the trainer's algorithm library")
    algorithms_sub = algorithms.add_subparsers(dest="algorithms_command", required=True)
    algorithms_sub.add_parser(
        "list", help="print every method: name, kind, paper, inputs"
    ).set_defaults(func=cmd_algorithms_list)
    return parser


CLOSED_STDOUT_EXIT = 141
"""Exit status when the reader of stdout went away (`flywheel status --json | head`): 128 +
SIGPIPE, what a Unix tool killed by SIGPIPE reports."""


def main(argv: list[str] | None = None) -> int:
    """The `flywheel` command. A closed stdout ends it quietly with `CLOSED_STDOUT_EXIT`, never a
    BrokenPipeError traceback."""
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe fails here at the latest
    except BrokenPipeError:
        # Python's own flush at exit would fail again (and print): point stdout at /dev/null.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no real file descriptor (tests)
            pass
        return CLOSED_STDOUT_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
