"""`flywheel check-fidelity`: does the engine, asked to score a recorded Sample's tokens again,
give the logprobs the gateway recorded? (ops/fidelity.py holds the comparison.)"""

from __future__ import annotations

import argparse
import sys
from typing import cast

from flywheel.core.settings import load_settings_or_exit


def cmd_check_fidelity(args: argparse.Namespace) -> int:
    """`flywheel check-fidelity --session ID [--tol T] [--timeout S]`: re-score each recorded
    Sample of the session on the running stack's engine; 0 when every one passes, 2 when one
    differs by more than `--tol`, 1 (a `flywheel:` line on stderr) when it cannot check."""
    import httpx  # noqa: PLC0415
    import redis  # noqa: PLC0415

    from flywheel.core.codec import decode_sample  # noqa: PLC0415
    from flywheel.core.config_files import mask_secrets  # noqa: PLC0415
    from flywheel.core.errors import ContractError  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.streams import FIELD  # noqa: PLC0415
    from flywheel.ops.fidelity import check_fidelity  # noqa: PLC0415
    from flywheel.ops.stack import running_stack  # noqa: PLC0415

    settings = load_settings_or_exit(args.config)
    state = running_stack(settings.state_dir)
    if not state:
        print(
            f"flywheel: no running stack in {settings.state_dir} (start one with `flywheel "
            "up`, or point FLYWHEEL_STATE_DIR at its state dir).",
            file=sys.stderr,
        )
        return 1
    client = connect(state["redis_url"])
    stream = settings.streams.key("rollouts")
    try:
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(stream))
    except redis.RedisError as exc:
        print(
            f"flywheel: cannot read {stream} from Redis at "
            f"{mask_secrets(state['redis_url'])}: {exc}",
            file=sys.stderr,
        )
        return 1
    samples, skipped = [], 0
    for _, fields in entries:
        # An entry that is not a Sample (the reward service dead-letters it but never removes
        # it from this stream) is skipped, not fatal: the session's own Samples still count.
        try:
            sample = decode_sample(fields[FIELD])
        except (KeyError, ContractError):
            skipped += 1
            continue
        if sample.session_id == args.session:
            samples.append(sample)
    if skipped:
        print(
            f"flywheel: skipped {skipped} undecodable entr{'y' if skipped == 1 else 'ies'} "
            f"of {stream} (no `sample` field, or not a valid Sample).",
            file=sys.stderr,
        )
    if not samples:
        print(
            f"flywheel: no recorded Sample of session {args.session} in {stream}; check the "
            "session id, and finish the session first (an episode's Samples are published at "
            "its finish).",
            file=sys.stderr,
        )
        return 1
    ok = True
    for sample in samples:
        try:
            report = check_fidelity(sample, state["engine"], timeout_s=args.timeout)
        except httpx.TimeoutException:
            print(
                f"flywheel: the engine at {state['engine']} did not re-score sample "
                f"{sample.sample_id} within {args.timeout:g} s (busy?); retry when it is idle "
                "or give a longer --timeout.",
                file=sys.stderr,
            )
            return 1
        except httpx.HTTPError as exc:
            print(
                f"flywheel: the engine at {state['engine']} failed to re-score sample "
                f"{sample.sample_id}: {exc!r}; check `flywheel status`.",
                file=sys.stderr,
            )
            return 1
        ok &= report.ok(args.tol)
        print(
            f"sample {sample.sample_id} (segment {sample.segment_index}, turn "
            f"{sample.turn_index}): ids_match={report.ids_match} "
            f"sampled_tokens={report.sampled_tokens} logprobs_compared="
            f"{report.logprobs_compared} max_abs_diff={report.max_abs_logprob_diff:.2e}"
            + (
                f" renormalized_tokens={report.renormalized_tokens} (grammar-renormalised "
                "logprobs, ids compared only)"
                if report.renormalized_tokens
                else ""
            )
        )
    return 0 if ok else 2
