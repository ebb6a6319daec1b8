"""CLI mistakes end in one clear line and a non-zero exit, never a traceback: config paths that
are directories or not UTF-8, list/dict settings in the environment that are not JSON, demo
flags below 1, and undecodable entries in the rollouts stream (skipped by check-fidelity)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import HTTPServer, ThreadingHTTPServer
from pathlib import Path

import pytest

from flywheel.core.codec import encode_sample, new_sample
from flywheel.core.streams import FIELD
from flywheel.ops import cli, fidelity
from flywheel.ops.stack import STATE_FILE

from .test_stack_race import _Ok  # a /healthz that answers 200


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)


def _exit_message(argv: list[str]) -> str:
    """The message `flywheel <argv>` exits with (sys.exit(str): exit status 1)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert isinstance(exc.value.code, str), exc.value.code
    assert exc.value.code.startswith("flywheel: ")
    return exc.value.code


def test_a_directory_as_config_file_is_named(tmp_path):
    message = _exit_message(["config", "show", "--config", str(tmp_path)])
    assert f"{tmp_path}: is a directory" in message and "TOML, YAML or JSON file" in message


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bin.toml"
    path.write_bytes(b"\xff\xfe\x00")
    message = _exit_message(["config", "show", "--config", str(path)])
    assert f"{path}: not UTF-8 text" in message and "save it as UTF-8" in message


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("FLYWHEEL_GATEWAY__ENGINE_URLS", "http://x", "a list setting takes a JSON value"),
        ("FLYWHEEL_TRAINER__ALGORITHM__REGULARIZERS", "k3", "a dict setting takes a JSON value"),
    ],
)
def test_an_env_value_that_is_not_json_names_the_variable(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    message = _exit_message(["config", "show"])
    assert f"{name}={value!r}: {expected}" in message
    assert "FLYWHEEL_TRAINER__OPTIM__LR" not in message  # only the variables that are wrong


def test_list_and_dict_settings_in_json_still_parse(monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_GATEWAY__ENGINE_URLS", '["http://x:1"]')
    monkeypatch.setenv("FLYWHEEL_TRAINER__ALGORITHM__REGULARIZERS", '{"k3": 0.1}')
    assert cli.main(["config", "show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["gateway"]["engine_urls"] == ["http://x:1"]
    assert shown["trainer"]["algorithm"]["regularizers"] == {"k3": 0.1}


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--group-size", "0"),
        ("--problems-per-step", "-1"),
        ("--steps", "0"),
        ("--steps", "-3"),
    ],
)
def test_demo_rejects_sizes_below_one_before_anything_starts(tmp_path, capsys, flag, value):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--new-stack", "--out", str(out), flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: must be at least 1, got {value}" in capsys.readouterr().err
    assert not out.exists()  # no stack (or its state dir) was started


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["up", "--bogus"], "usage: flywheel up "),
        (["config", "show", "--bogus"], "usage: flywheel config show "),
        (["engines", "list", "--bogus"], "usage: flywheel engines list "),
    ],
)
def test_an_unknown_flag_is_refused_with_the_subcommands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err  # not the top-level `usage: flywheel [-h] {up,...}`
    assert f"{usage.removeprefix('usage: ').strip()}: error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(
    ("argv", "prog", "subcommands"),
    [
        (["config"], "flywheel config", "show"),
        (["keys"], "flywheel keys", "create, list, mark, revoke, reopen"),
        (["engines"], "flywheel engines", "list, add, remove"),
    ],
)
def test_a_command_without_its_subcommand_shows_its_usage_and_subcommands(
    capsys, argv, prog, subcommands
):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith(f"usage: {prog} [-h] {{"), err
    assert f"{prog}: error: name a subcommand: {subcommands}" in err, err
    assert "_command" not in err and "arguments are required" not in err, err


def test_config_show_refuses_algorithm_params_that_up_refuses(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(
        '[trainer.algorithm]\npolicy_loss = "ppo_clip"\n'
        "[trainer.algorithm.params.ppo_clip]\nclip_epsilon_typo = 0.2\n"
    )
    assert cli.main(["config", "show", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed as if it were the resolved settings
    assert "algorithm part 'ppo_clip' takes no parameters" in captured.err
    assert "clip_epsilon_typo" in captured.err


def test_config_show_accepts_a_recipe_the_trainer_accepts(capsys):
    recipe = Path(__file__).parents[3] / "recipes" / "dapo.toml"
    assert cli.main(["config", "show", "--config", str(recipe)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["trainer"]["algorithm"]["loss_aggregation"] == "token_mean"  # the file's


def _sample(session: str):
    return new_sample(
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        rollout_logprobs=[0.0, -1, -2],
        weight_versions=[-1, 0, 0],
        prompt_length=1,
        session_id=session,
    )


def test_check_fidelity_skips_undecodable_entries(
    tmp_path, redis_server, redis_client, prefix, monkeypatch, capsys
):
    gateway = HTTPServer(("127.0.0.1", 0), _Ok)  # the running stack's gateway answers
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{gateway.server_port}"
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {"pid": os.getpid(), "gateway": url, "engine": url, "redis_url": redis_server.url}
        )
    )
    config = tmp_path / "flywheel.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n[streams]\nprefix = "{prefix}"\n')
    stream = f"{prefix}:rollouts"
    redis_client.xadd(stream, {FIELD: b"\xff\x00garbage"})  # dead-lettered, still in the stream
    redis_client.xadd(stream, {b"other": b"x"})  # no `sample` field
    mine = _sample("s1")
    redis_client.xadd(stream, {FIELD: encode_sample(mine)})
    redis_client.xadd(stream, {FIELD: encode_sample(_sample("s2"))})
    checked = []

    def check(sample, engine_url, timeout_s):
        checked.append((sample.sample_id, engine_url))
        return fidelity.FidelityReport(
            ids_match=True, logprobs_compared=True, max_abs_logprob_diff=0.0, sampled_tokens=2
        )

    monkeypatch.setattr(fidelity, "check_fidelity", check)
    try:
        rc = cli.main(["check-fidelity", "--config", str(config), "--session", "s1"])
    finally:
        gateway.shutdown()
    out = capsys.readouterr()
    assert rc == 0
    assert checked == [(mine.sample_id, url)]
    assert f"skipped 2 undecodable entries of {stream}" in out.err
    assert f"sample {mine.sample_id}" in out.out


class _Slow(_Ok):
    """An engine that takes 2 s to answer (busy with other rows)."""

    def do_POST(self) -> None:  # noqa: N802
        time.sleep(2)
        self.send_response(200)
        self.end_headers()


def test_check_fidelity_on_a_busy_engine_is_a_one_line_error_naming_timeout(
    tmp_path, redis_server, redis_client, prefix, capsys
):
    gateway = HTTPServer(("127.0.0.1", 0), _Ok)
    engine = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    for server in (gateway, engine):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "gateway": f"http://127.0.0.1:{gateway.server_port}",
                "engine": f"http://127.0.0.1:{engine.server_port}",
                "redis_url": redis_server.url,
            }
        )
    )
    config = tmp_path / "flywheel.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n[streams]\nprefix = "{prefix}"\n')
    redis_client.xadd(f"{prefix}:rollouts", {FIELD: encode_sample(_sample("s1"))})
    argv = ["check-fidelity", "--config", str(config), "--session", "s1", "--timeout", "0.3"]
    try:
        rc = cli.main(argv)
    finally:
        gateway.shutdown()
        engine.shutdown()
    err = capsys.readouterr().err
    assert rc == 1
    assert "within 0.3 s" in err and "--timeout" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    with pytest.raises(SystemExit):  # a timeout must be a number above 0
        cli.main([*argv[:-1], "0"])
