"""`flywheel engines list|add|remove`: the shared engine fleet (core/fleet.py) from the command
line, read and written in the deployment's Redis like `POST/DELETE /v1/admin/engines`. Every
gateway and the trainer see a change within `fleet.refresh_s`; an added engine serves once it
has the fleet's weight version (docs/fleet.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def install(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the `engines` command to the `flywheel` parser's subcommands `sub`."""
    engines = sub.add_parser("engines", help="the engine fleet shared by gateways and trainer")
    engines_sub = engines.add_subparsers(dest="engines_command", required=True)
    listing = engines_sub.add_parser(
        "list", help="engines, their source and served weight version", parents=[common]
    )
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    add = engines_sub.add_parser(
        "add", help="add an engine (served once it has the current weights)", parents=[common]
    )
    add.add_argument("url", help="engine base URL, e.g. http://10.0.0.7:30000")
    remove = engines_sub.add_parser(
        "remove", help="remove an engine (only its sessions move)", parents=[common]
    )
    remove.add_argument("url", help="engine base URL as `flywheel engines list` shows it")
    remove.add_argument(
        "--force",
        action="store_true",
        help="remove it even when no other engine answers (every request then fails)",
    )
    engines.set_defaults(func=cmd_engines)


def served_version(url: str) -> int | None:
    """The weight version `url` serves, or None when it does not answer in 5 s."""
    import httpx  # noqa: PLC0415

    from flywheel.core.versions import parse_weight_version  # noqa: PLC0415

    for path in ("/model_info", "/get_model_info"):
        try:
            reply = httpx.get(f"{url}{path}", timeout=5.0)
        except httpx.HTTPError:
            return None
        if reply.status_code == 200:
            return parse_weight_version(reply.json().get("weight_version"))
        if reply.status_code != 404:
            return None
    return None


def answers_health(url: str) -> bool:
    """Whether the engine at `url` answers `GET /health` with 200 within 5 s."""
    import httpx  # noqa: PLC0415

    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def cmd_engines(args: argparse.Namespace) -> int:
    """Run `flywheel engines <list|add|remove>`; a bad URL, an unreachable Redis, removing the
    last engine that answers (without `--force`), or a change to a deployment this folder did
    not start and that was not named (ops/target.py) ends with a one-line message (exit 1)."""
    from flywheel.core.fleet import Fleet, normalize_url, static_urls  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.settings import load_settings_or_exit  # noqa: PLC0415
    from flywheel.ops.target import resolve  # noqa: PLC0415

    settings = load_settings_or_exit(args.config)
    target = resolve(settings, args.config)
    if args.engines_command == "list":
        if target.note():
            print(target.note(), file=sys.stderr)
    else:
        target.refuse_change(f"{args.engines_command} an engine")
    redis_url = target.redis_url
    fleet = Fleet(connect(redis_url), settings.streams.prefix, static_urls(settings))
    try:
        if args.engines_command == "list":
            from flywheel.ops.status import engine_state  # noqa: PLC0415

            version = fleet.version()
            rows = []
            for url, source in fleet.members().items():
                served = served_version(url)
                state = engine_state(served, version)
                rows.append(
                    {"url": url, "source": source, "state": state, "weight_version": served}
                )
            if args.json:
                print(json.dumps({"weight_version": version, "engines": rows}))
                return 0
            print(f"fleet weight version {version}")
            for row in rows:
                shown = "no answer" if row["weight_version"] is None else row["weight_version"]
                print(f"{row['url']}  {row['source']:6}  {row['state']:10}  serves {shown}")
            if not rows:
                print("no engines (a gateway or trainer adds the configured ones at start)")
            return 0
        url = normalize_url(args.url)  # one spelling: no trailing slash (docs/fleet.md)
        if args.engines_command == "add":
            if not fleet.add(url):
                print(f"{url} is already in the fleet")
            elif answers_health(url):
                print(
                    f"added {url}; gateways route to it once it serves weight version "
                    f"{fleet.version()} (the trainer pushes it within fleet.refresh_s)"
                )
            else:
                print(
                    f"added {url}, but it does not answer {url}/health: it stays pending (no "
                    f"request is routed to it) until it answers and serves weight version "
                    f"{fleet.version()}. Check the address, or `flywheel engines remove {url}`"
                )
            return 0
        members = fleet.members()
        if url not in members:
            sys.exit(f"flywheel: {url} is not in the fleet; `flywheel engines list` shows it")
        others = [u for u in members if u != url]
        if not args.force and answers_health(url) and not any(answers_health(u) for u in others):
            sys.exit(
                f"flywheel: {url} is the last engine that answers: removing it leaves no engine "
                "to serve, and every request fails (502) until one is added. Add another first "
                "(`flywheel engines add URL`), or pass --force to remove it anyway"
            )
        fleet.remove(url)
        print(f"removed {url}; its sessions move to the other engines")
    except ValueError as exc:
        sys.exit(f"flywheel: {exc}")
    except Exception as exc:  # noqa: BLE001  (CLI edge: a message, not a traceback)
        sys.exit(f"flywheel: {exc} (Redis at {redis_url.split('@')[-1]}; is the stack up?)")
    return 0
