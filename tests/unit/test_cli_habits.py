"""replicactl's `sky serve` habits without a controller: flags, help, names, env files, narrow
tables, status messages and watch lines."""

from __future__ import annotations

import argparse
import io
import re

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client, inputs, main, render
from services.common import spec, watchlines
from tests.unit.test_cli import NOW, replica, service

# ---- flags -------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return main.parser().parse_args(list(argv))


def test_status_takes_several_names_verbose_and_endpoint() -> None:
    args = parse("status", "a", "b", "-v")
    assert (args.names, args.verbose, args.endpoint) == (["a", "b"], True, False)
    args = parse("status", "--endpoint", "web")
    assert (args.names, args.endpoint) == (["web"], True)
    assert parse("status").names == []


def test_down_takes_several_names_all_and_yes() -> None:
    args = parse("down", "a", "b", "-y")
    assert (args.names, args.all, args.yes) == (["a", "b"], False, True)
    args = parse("down", "--all", "--yes")
    assert (args.names, args.all, args.yes) == ([], True, True)


def test_logs_takes_the_replica_id_as_a_position_and_follows_by_default() -> None:
    args = parse("logs", "shop", "3")
    assert (args.name, args.replica, args.follow) == ("shop", 3, True)
    assert parse("logs", "shop", "3", "--no-follow").follow is False
    assert parse("logs", "shop", "--replica-id", "3").replica_id == 3  # the older spelling still works
    args = parse("--controller", "10.0.0.1:5", "logs", "shop", "--controller")
    assert (args.controller, args.controller_log, args.load_balancer) == ("10.0.0.1:5", True, False)
    args = parse("logs", "shop", "--load-balancer", "--sync-down", "--dir", "out")
    assert (args.load_balancer, args.sync_down, args.dir) == (True, True, "out")


def _actions(p: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((f"{path} {name}", argparse.Action([], name, help=helps.get(name))))
                found += _actions(sub, f"{path} {name}")
            continue
        found.append((f"{path} {'/'.join(action.option_strings) or action.dest}", action))
    return found


def test_every_command_positional_and_option_has_help() -> None:
    actions = _actions(main.parser(), "replicactl")
    assert len(actions) > 50  # the walk reached every command
    missing = [where for where, action in actions if not (action.help or "").strip()]
    assert missing == []


def test_help_shows_a_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse("--help")
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "Example" in text
    for line in (
        "replicactl up examples/hello/service.yaml --wait",
        "replicactl status",
        "replicactl logs hello 1",
        "replicactl down hello",
    ):
        assert line in text, line
    assert "--env" in parse_help("up") and "bare KEY" in parse_help("up")


def parse_help(command: str) -> str:
    out = io.StringIO()
    main.parser()._subparsers._group_actions[0].choices[command].print_help(out)  # type: ignore[union-attr]
    return out.getvalue()


# ---- names, env and secret flags -------------------------------------------------------------


def test_a_generated_name_is_readable_valid_and_varies() -> None:
    names = {inputs.generate_name() for _ in range(200)}
    assert len(names) > 150
    for name in names:
        assert re.fullmatch(r"service-[a-z]+-[0-9a-f]{4}", name), name
        assert spec.validate_service_name(name) == []


def test_env_and_secret_flags_take_values_or_the_callers_environment(tmp_path) -> None:
    env_file = tmp_path / "a.env"
    env_file.write_text(
        "# comment\n\nexport A=from-file\nB = 'single # not a comment'\nC=\"line\\nbreak\"\nD=plain # comment\nE=\nF\n"
    )
    environ = {"F": "f-from-env", "G": "g-from-env", "TOKEN": "t0k"}
    envs, secrets = inputs.overrides(
        envs=["A=cli", "G", "H=x=y"], env_files=[str(env_file)], secrets=["TOKEN", "S="], environ=environ
    )
    assert envs == {
        "A": "cli",
        "B": "single # not a comment",
        "C": "line\nbreak",
        "D": "plain",
        "E": "",
        "F": "f-from-env",
        "G": "g-from-env",
        "H": "x=y",
    }
    assert secrets == {"TOKEN": "t0k", "S": ""}


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ({"envs": ["MISSING"]}, "--env MISSING: MISSING is not set in your environment (or give MISSING=VALUE)"),
        ({"secrets": ["NOPE"]}, "--secret NOPE: NOPE is not set in your environment (or give NOPE=VALUE)"),
        ({"envs": ["1X=2"]}, "--env 1X: not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"),
        (
            {"secrets": ["bad-key=hunter2"]},
            "--secret bad-key: not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
        ),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_key_never_the_value(flags: dict[str, list[str]], line: str) -> None:
    with pytest.raises(inputs.InputError) as bad:
        inputs.overrides(**{"envs": [], "env_files": [], "secrets": [], **flags}, environ={})  # type: ignore[arg-type]
    assert str(bad.value) == line
    assert "hunter2" not in str(bad.value)


def test_a_bad_env_file_names_the_file_and_line(tmp_path) -> None:
    env_file = tmp_path / "bad.env"
    env_file.write_text("A=1\nnot valid line\n")
    with pytest.raises(inputs.InputError) as bad:
        inputs.overrides(envs=[], env_files=[str(env_file)], secrets=[], environ={})
    assert str(bad.value) == f"--env-file {env_file}:2: expected KEY=VALUE"
    with pytest.raises(inputs.InputError) as missing:
        inputs.overrides(envs=[], env_files=[str(tmp_path / "nope.env")], secrets=[], environ={})
    assert str(missing.value) == f"--env-file {tmp_path / 'nope.env'}: no such file"


def test_a_hint_names_the_flag_for_an_empty_value() -> None:
    line = client.hint_overrides(
        [("envs.MODEL", 'needs a value; use an empty string ("") for an empty one'), ("service.replicas", "bad")]
    )
    assert line == [
        ("envs.MODEL", 'needs a value; use an empty string ("") for an empty one (or pass --env MODEL=VALUE)'),
        ("service.replicas", "bad"),
    ]
    assert client.hint_overrides([("secrets.HF", "needs a value")]) == [
        ("secrets.HF", "needs a value (or pass --secret HF=VALUE, or --secret HF to take it from your environment)")
    ]


# ---- status ------------------------------------------------------------------------------


def test_plain_status_shows_that_scaling_stopped_while_the_old_version_serves() -> None:
    stopped = "scaling stopped: version 2 failed before ever being ready (replica 3: app exited with code 1)"
    svc = service(status_message=stopped)  # READY: version 1 still serves
    text = render.status_text([svc], [], tty=False, now=NOW)
    assert f"hello: {stopped}" in text
    routine = service(status_message="2/2 ready, target 2")
    assert "target 2" not in render.status_text([routine], [], tty=False, now=NOW)
    assert "hello: 2/2 ready, target 2" in render.status_text([routine], [], tty=False, show_all=True, now=NOW)


def test_status_all_groups_the_lines_of_each_service() -> None:
    a = service(name="alpha", status_message="1/1 ready, target 1", probing_stale=True)
    b = service(name="beta", status_message="2/2 ready, target 2")
    for svc in (a, b):
        svc.autoscaler.kind = "request_rate"
        svc.autoscaler.target_replicas = 1
    text = render.status_text([a, b], [], tty=False, show_all=True, now=NOW)
    names = [line.split(":")[0] for line in text.split("\n\n")[1].splitlines()]
    assert names == ["alpha", "alpha", "alpha", "beta", "beta"]


def test_verbose_status_adds_policy_and_resources_columns() -> None:
    svc = service()
    svc.spec.service.replica_policy.min_replicas = 1
    svc.spec.service.replica_policy.max_replicas = 3
    svc.spec.service.replica_policy.target_qps_per_replica = 5
    svc.spec.service.load_balancing_policy = 1
    svc.spec.resources.cpus = "2+"
    svc.spec.resources.accelerators = "A100:1"
    svc.spec.resources.use_spot = True
    lines = render.status_text([svc], [], tty=False, verbose=True, now=NOW).splitlines()
    assert lines[1].split() == [*render.SERVICE_HEADERS, "AUTOSCALING", "LB_POLICY", "RESOURCES"]
    assert "1..3 replicas at 5 qps each" in lines[2]
    assert "round_robin" in lines[2]
    assert "cpus=2+ A100:1 spot" in lines[2]
    fixed = service()
    fixed.spec.service.replica_policy.min_replicas = 2
    fixed.spec.service.replica_policy.max_replicas = 2
    assert render.verbose_cells(fixed) == ("fixed 2 replicas", "least_load", "-")


LONG_NAME = "customer-facing-recommendation-service-eu"
LONG_URL = "https://recommendations.internal.example.com:30001"


def _wide_case() -> tuple[list[res.Service], list[res.Replica]]:
    svc = service(name=LONG_NAME, load_balancer_url=LONG_URL)
    reps = [
        replica(1, service=LONG_NAME, endpoint="http://127.77.100.201:18080"),
        replica(
            2,
            service=LONG_NAME,
            status=res.REPLICA_STATUS_FAILED,
            endpoint="",
            failure_reason="launch failed: setup exited with code 1 after installing dependencies",
        ),
    ]
    return [svc], reps


@pytest.mark.parametrize("tty", [True, False])
@pytest.mark.parametrize("width", [80, 72, 60])
def test_narrow_tables_keep_names_and_urls_whole(tty: bool, width: int) -> None:
    services, replicas = _wide_case()
    text = render.status_text(services, replicas, tty=tty, show_all=True, verbose=True, now=NOW, width=width)
    lines = text.splitlines()
    assert max(len(strip_ansi(line)) for line in lines) <= width, "\n" + text
    for whole in (LONG_NAME, LONG_URL, "http://127.77.100.201:18080", "SERVICE", "ENDPOINT", "STATUS"):
        assert any(whole in strip_ansi(line) for line in lines), (whole, text)
    assert "FAILED" in text and "READY" in text


def test_too_narrow_for_any_table_folds_each_row_into_lines() -> None:
    services, replicas = _wide_case()
    text = render.status_text(services, replicas, tty=False, now=NOW, width=40)
    lines = text.splitlines()
    assert lines[lines.index("  NAME") + 1] == f"    {LONG_NAME}"
    assert "  STATUS    READY" in lines
    # A value too long for its line goes on a line of its own, whole.
    assert lines[lines.index("  ENDPOINT") + 1] == f"    {LONG_URL}"
    assert "  ENDPOINT  http://127.77.100.201:18080" in lines
    # Only a single value longer than the width may pass it, and it is never split.
    assert all(len(line) <= 40 or LONG_NAME in line or LONG_URL in line for line in lines)


@pytest.mark.parametrize("tty", [True, False])
def test_at_80_columns_optional_columns_go_first_and_reasons_wrap_at_words(tty: bool) -> None:
    svc = service(name="checkout-api", load_balancer_url="http://127.0.0.1:30001")
    reason = "launch failed: setup exited with code 1 after installing the dependencies of version 2"
    reps = [
        replica(1, service="checkout-api", endpoint="http://127.77.1.2:8080"),
        replica(2, service="checkout-api", status=res.REPLICA_STATUS_FAILED, endpoint="", failure_reason=reason),
    ]
    text = strip_ansi(render.status_text([svc], reps, tty=tty, show_all=True, now=NOW, width=80))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n" + text
    header = next(line for line in lines if "SERVICE" in line)
    for kept in ("SERVICE", "ID", "ENDPOINT", "STATUS", "REASON"):
        assert kept in header, text
    assert "NAME" not in header.replace("SERVICE", "")  # the replica name went first
    assert any("http://127.77.1.2:8080" in line for line in lines)
    words = " ".join(line for line in lines if "checkout-api" in line or line.startswith(" ")).split()
    assert "dependencies" in words and "installing" in words  # wrapped between words, not inside


def test_wide_enough_tables_are_unchanged() -> None:
    services, replicas = _wide_case()
    unlimited = render.status_text(services, replicas, tty=False, now=NOW)
    assert render.status_text(services, replicas, tty=False, now=NOW, width=250) == unlimited
    assert "LAUNCHED" in unlimited


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# ---- watch lines ---------------------------------------------------------------------------


def _change(*replicas: res.Replica) -> pb.WatchServiceResponse:
    svc = res.Service(name="web", status=res.SERVICE_STATUS_REPLICA_INIT, total_replicas=1, active_versions=[])
    return pb.WatchServiceResponse(service=svc, replicas=replicas)


def test_watch_prints_each_launch_retry_and_its_reason() -> None:
    printer = watchlines.WatchPrinter()
    provisioning = res.Replica(service="web", replica_id=1, status=res.REPLICA_STATUS_PROVISIONING)
    assert printer.lines(_change(provisioning))[0] == "web: replica 1 PROVISIONING (0/1 ready)"
    provisioning.failure_reason = "launch attempt 1 failed: setup exited with code 1"
    assert printer.lines(_change(provisioning)) == [
        "web: replica 1 PROVISIONING: launch attempt 1 failed: setup exited with code 1 (0/1 ready)"
    ]
    assert printer.lines(_change(provisioning)) == []
    provisioning.failure_reason = "launch attempt 2 failed: setup exited with code 1"
    assert printer.lines(_change(provisioning)) == [
        "web: replica 1 PROVISIONING: launch attempt 2 failed: setup exited with code 1 (0/1 ready)"
    ]
    ready = res.Replica(service="web", replica_id=1, status=res.REPLICA_STATUS_READY, endpoint="http://127.77.0.1:8080")
    assert printer.lines(_change(ready)) == ["web: replica 1 READY at http://127.77.0.1:8080 (0/1 ready)"]
