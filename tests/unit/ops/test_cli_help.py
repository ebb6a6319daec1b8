"""`flywheel --help` and each subcommand's help: every command named at the top, every option
explained with its default, the state dir named where a stack is started or stopped, and the
`flywheel:` prefix on check-fidelity's refusals."""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from flywheel.ops import cli
from flywheel.ops.stack import STATE_FILE


class _Ok(BaseHTTPRequestHandler):
    """A running stack's gateway: `/healthz` answers 200."""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by its full name ("up", "config show", "engines list", ...)."""
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out |= {f"{name} {k}": v for k, v in _subparsers(sub).items()}
    return out


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_the_top_level_help_names_every_command(capsys):
    text = _help([], capsys)
    top = [name for name in _subparsers(cli.build_parser()) if " " not in name]
    assert {"up", "down", "demo", "engines", "check-fidelity"} <= set(top)
    missing = [name for name in top if f"`{name}" not in text.split("positional arguments")[0]]
    assert missing == [], f"the description leaves out {missing}"


def test_every_option_of_every_command_has_help_and_its_default():
    for command, parser in _subparsers(cli.build_parser()).items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            flag = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
            where = f"flywheel {command} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{where} has no help text"
            shows_default = action.default not in (None, False, argparse.SUPPRESS)
            if shows_default and action.option_strings and not flag:
                assert "default" in action.help, f"{where}: the help hides its default"


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["demo"], ["--seed", "seed of the training problems"]),
        (["check-fidelity"], ["--tol", "(default 1e-4)"]),
    ],
)
def test_named_options_explain_themselves(capsys, argv, shown):
    text = " ".join(_help(argv, capsys).split())  # argparse wraps lines
    for part in shown:
        assert part in text


@pytest.mark.parametrize("command", ["up", "down"])
def test_up_and_down_name_the_state_dir_and_its_variable(capsys, command):
    text = " ".join(_help([command], capsys).split())
    assert "state dir" in text and "FLYWHEEL_STATE_DIR" in text and ".flywheel" in text


def test_check_fidelity_refusals_carry_the_flywheel_prefix(tmp_path, redis_server, prefix, capsys):
    config = tmp_path / "flywheel.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n[streams]\nprefix = "{prefix}"\n')
    assert cli.main(["check-fidelity", "--config", str(config), "--session", "nope"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"flywheel: no running stack in {tmp_path}")
    gateway = HTTPServer(("127.0.0.1", 0), _Ok)  # a running stack whose gateway answers
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{gateway.server_port}"
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {"pid": os.getpid(), "gateway": url, "engine": url, "redis_url": redis_server.url}
        )
    )
    try:
        rc = cli.main(["check-fidelity", "--config", str(config), "--session", "nope"])
    finally:
        gateway.shutdown()
    out = capsys.readouterr()
    assert rc == 1 and out.out == ""
    assert out.err.startswith("flywheel: no recorded Sample of session nope in "), out.err
    assert len(out.err.strip().splitlines()) == 1
