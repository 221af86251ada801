"""replicactl without a controller: argument parsing, rendering and error lines."""

from __future__ import annotations

import io
import json
import os

import pytest
from google.protobuf import timestamp_pb2

from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import lifecycle, main, render
from services.common import spec, specfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOW = 1_700_000_000.0


def ts(seconds: float) -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.FromSeconds(int(seconds))
    return t


def service(**fields: object) -> res.Service:
    base: dict[str, object] = {
        "name": "hello",
        "status": res.SERVICE_STATUS_READY,
        "ready_replicas": 2,
        "total_replicas": 2,
        "active_versions": [1],
        "latest_version": 1,
        "uptime_start_time": ts(NOW - 125),
        "endpoints": [
            res.Endpoint(replica_id=2, url="http://127.77.0.2:8080"),
            res.Endpoint(replica_id=1, url="http://127.77.0.1:8080"),
        ],
    }
    return res.Service(**{**base, **fields})  # type: ignore[arg-type]


def replica(rid: int, **fields: object) -> res.Replica:
    base: dict[str, object] = {
        "service": "hello",
        "replica_id": rid,
        "version": 1,
        "status": res.REPLICA_STATUS_READY,
        "endpoint": f"http://127.77.0.{rid}:8080",
        "launch_time": ts(NOW - 60),
        "zone": "zone-a",
        "replica_name": f"hello-{rid}-abc",
    }
    return res.Replica(**{**base, **fields})  # type: ignore[arg-type]


def test_rows_show_what_sky_serve_status_shows() -> None:
    assert render.service_row(service(), NOW) == (
        "hello",
        "1",
        "2m 5s",
        "READY",
        "2/2",
        "http://127.77.0.1:8080 (+1)",
    )
    failed = replica(3, status=res.REPLICA_STATUS_FAILED, failure_reason="app exited with code 1", endpoint="")
    assert render.replica_row(failed, NOW) == ("hello", "3", "1", "-", "1m 0s ago", "FAILED", "app exited with code 1")
    assert render.replica_row(replica(1), NOW, extra=True)[-3:] == ("zone-a", "no", "hello-1-abc")
    starting = service(status=res.SERVICE_STATUS_REPLICA_INIT, ready_replicas=0, endpoints=[], active_versions=[])
    starting.ClearField("uptime_start_time")
    assert render.service_row(starting, NOW) == ("hello", "1", "-", "REPLICA_INIT", "0/2", "-")


def test_unknown_enum_values_and_durations_render() -> None:
    assert render.service_status(99) == "UNKNOWN_99"
    assert render.replica_status(res.REPLICA_STATUS_FAILED_INITIAL_DELAY) == "FAILED_INITIAL_DELAY"
    assert [render.duration(s) for s in (5, 61, 3 * 3600 + 120, 2 * 86400 + 3600)] == ["5s", "1m 1s", "3h 2m", "2d 1h"]


def test_plain_table_when_not_a_terminal_and_rich_on_one() -> None:
    text = render.status_text([service()], [replica(1), replica(2)], tty=False, now=NOW)
    lines = text.splitlines()
    assert lines[0] == "Services"
    assert lines[1] == "NAME   VERSION  UPTIME  STATUS  REPLICAS  ENDPOINT"
    assert lines[2].startswith("hello  1        2m 5s   READY   2/2")
    assert "Service Replicas" in lines
    assert all(line == line.rstrip() for line in lines)
    assert "\x1b[" not in text
    fancy = render.status_text([service()], [replica(1)], tty=True, now=NOW)
    assert "\x1b[" in fancy and "READY" in fancy and "NAME" in fancy


def test_status_messages_and_stale_probing_are_shown() -> None:
    svc = service(status_message="scaling stopped: version 2 failed", probing_stale=True)
    svc.status = res.SERVICE_STATUS_NO_REPLICA
    text = render.status_text([svc], [], tty=False, now=NOW)
    assert "hello: scaling stopped: version 2 failed" in text
    assert "hello: probing is stale" in text


def test_json_uses_the_proto_field_names_and_enum_names() -> None:
    doc = json.loads(render.to_json({"services": [service()], "replicas": [replica(1)]}))
    assert doc["services"][0]["ready_replicas"] == 2
    assert doc["services"][0]["status"] == "SERVICE_STATUS_READY"
    assert doc["replicas"][0]["replica_id"] == "1"


def test_json_lines_are_compact() -> None:
    line = render.to_json({"change": service()}, indent=None)
    assert "\n" not in line and "  " not in line
    assert json.loads(line)["change"]["name"] == "hello"


def test_plan_text_says_what_an_update_does() -> None:
    plan = res.UpdatePlan(new_version=2, kept_replica_ids=[1, 2], launch_count=1, in_place=True)
    text = render.plan_text("hello", plan, dry_run=True)
    assert text.splitlines() == [
        "hello: version 2 (dry run, nothing changed)",
        "  kept in place: 1, 2 (only the service section changed)",
        "  would launch: 1 new replica(s)",
        "  would tear down: none",
    ]


def test_error_lines_name_the_fields_and_are_clipped() -> None:
    line = render.error_line("INVALID_ARGUMENT", "invalid spec", [("service.replicas", "must be >= 0, got -1")])
    assert line == "error: service.replicas: must be >= 0, got -1"
    assert render.error_line("NOT_FOUND", "service 'x' not found") == "error: service 'x' not found"
    assert len(render.error_line("INTERNAL", "x" * 5000)) < 220


def test_argument_parsing_and_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = main.parser().parse_args(["update", "hello", "v2.yaml", "--mode", "blue_green", "--dry-run"])
    assert (args.name, args.spec, args.mode, args.dry_run) == ("hello", "v2.yaml", "blue_green", True)
    args = main.parser().parse_args(["down", "hello", "--replica-id", "3", "--purge"])
    assert (args.replica_id, args.purge, args.failed_only) == (3, True, False)
    with pytest.raises(SystemExit) as exit_:
        main.parser().parse_args(["update", "hello", "v2.yaml", "--mode", "sideways"])
    assert exit_.value.code == main.BAD_INPUT
    assert "error: argument --mode" in capsys.readouterr().err


def test_controller_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(main.ENV_CONTROLLER, "10.0.0.1:6000")
    assert main.parser().parse_args(["status"]).controller == "10.0.0.1:6000"
    monkeypatch.delenv(main.ENV_CONTROLLER)
    assert main.parser().parse_args(["status"]).controller == "127.0.0.1:50051"


def test_a_missing_spec_file_is_one_line_and_exit_2(tmp_path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main.run(["--controller", "127.0.0.1:1", "up", str(tmp_path / "nope.yaml")], out=out, err=err)
    assert code == main.BAD_INPUT
    assert err.getvalue() == f"error: no such file: {tmp_path / 'nope.yaml'}\n"


@pytest.mark.parametrize(
    "path",
    [
        "examples/hello/service.yaml",
        "examples/autoscale/service.yaml",
        "examples/spot/service.yaml",
        "examples/broken-v2/v1.yaml",
        "examples/broken-v2/v2.yaml",
    ],
)
def test_every_example_is_a_valid_spec_with_a_workdir_that_exists(path: str) -> None:
    text = specfile.read_spec(os.path.join(REPO, path))
    parsed = spec.parse(text, require_name=True)
    assert os.path.isfile(os.path.join(REPO, "examples", "hello", "app.py"))
    assert parsed is not None


def test_all_adds_the_autoscaler_status() -> None:
    svc = service()
    svc.autoscaler.kind = "request_rate"
    svc.autoscaler.target_replicas = 2
    svc.autoscaler.min_replicas = 1
    svc.autoscaler.max_replicas = 3
    svc.autoscaler.qps = 1.5
    svc.autoscaler.last_decision_reason = "scale up to 2 in 5 s unless the load changes"
    line = "hello: autoscaler request_rate: target 2 (1..3), 1.50 qps; scale up to 2 in 5 s unless the load changes"
    assert render.autoscaler_line(svc) == line
    assert line in render.status_text([svc], [], tty=False, show_all=True, now=NOW)
    assert "autoscaler" not in render.status_text([svc], [], tty=False, now=NOW)
    assert render.autoscaler_line(service()) == ""


def test_orphans_table_shows_owner_age_and_why() -> None:
    mine = res.Orphan(
        replica_name="web-3-ab12cd34",
        service_name="web",
        replica_id=3,
        version=2,
        owner="ctl-me",
        owned_by_this_controller=True,
        state="RUNNING",
        reason='no service "web"',
        create_time=timestamp_pb2.Timestamp(seconds=1_000),
    )
    theirs = res.Orphan(replica_name="api-1-00ff00ff", service_name="api", replica_id=1, owner="ctl-other")
    text = render.orphans_text([mine, theirs], "ctl-me", tty=False, now=1_065)
    lines = text.splitlines()
    assert lines[0] == "controller id: ctl-me"
    assert lines[2].split() == ["NAME", "SERVICE", "ID", "VERSION", "STATE", "AGE", "OWNER", "REASON"]
    assert "web-3-ab12cd34" in lines[3] and "1m 5s" in lines[3] and "this controller" in lines[3]
    assert "ctl-other" in lines[4] and lines[4].split()[5] == "-"
    assert render.orphans_text([], "ctl-me", tty=False) == "controller id: ctl-me\nNo orphans.\n"


def test_orphans_options_that_only_go_with_reap_exit_2() -> None:
    args = main.parser().parse_args(["orphans", "--reap", "--owner", "ctl-x", "--name", "a-1", "--name", "b-2"])
    assert (args.reap, args.owner, args.name, args.all_owners) == (True, "ctl-x", ["a-1", "b-2"], False)
    with pytest.raises(SystemExit) as exit_:
        main.parser().parse_args(["orphans", "--reap", "--owner", "x", "--all-owners"])
    assert exit_.value.code == main.BAD_INPUT
    out, err = io.StringIO(), io.StringIO()
    assert main.run(["--controller", "127.0.0.1:1", "orphans", "--all-owners"], out=out, err=err) == main.BAD_INPUT
    assert err.getvalue() == "error: --all-owners, --name and --wait go with --reap\n"


class _UpdateRecorder:
    """Stands in for the client: records the UpdateService request, answers an empty plan."""

    def __init__(self) -> None:
        self.requests: list[object] = []

    def call(self, name: str, request: object) -> object:
        from replicaplane.controller.v1 import controller_service_pb2 as pb

        assert name == "UpdateService"
        self.requests.append(request)
        return pb.UpdateServiceResponse(plan=res.UpdatePlan(new_version=2))


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ([], res.UPDATE_MODE_UNSPECIFIED),  # the spec's service.rollout.strategy, else rolling
        (["--mode", "rolling"], res.UPDATE_MODE_ROLLING),
        (["--mode", "blue_green"], res.UPDATE_MODE_BLUE_GREEN),
        (["--mode", "canary"], res.UPDATE_MODE_CANARY),
    ],
)
def test_update_sends_the_mode_asked_for_and_none_by_default(
    tmp_path: os.PathLike[str], flags: list[str], mode: int
) -> None:
    path = os.path.join(tmp_path, "v2.yaml")
    with open(path, "w") as fh:
        fh.write("service:\n  replicas: 1\nresources:\n  ports: 8080\nrun: serve\n")
    args = main.parser().parse_args(["update", "hello", path, "--json", *flags])
    client = _UpdateRecorder()
    assert lifecycle.cmd_update(args, client, io.StringIO()) == main.OK  # type: ignore[arg-type]
    (request,) = client.requests
    assert request.mode == mode  # type: ignore[attr-defined]


def test_status_shows_a_canary_rollout_under_the_table() -> None:
    rollout = res.RolloutStatus(
        stable_version=1,
        canary_version=2,
        state=res.ROLLOUT_STATE_PROGRESSING,
        step=1,
        step_count=2,
        canary_weight=10,
        message="step 1/2 (10 %): pausing until 42 s from now",
    )
    svc = service(rollout=rollout, latest_version=2, active_versions=[1, 2])
    assert render.rollout_line(svc) == (
        "hello: canary: version 2 from 1, step 1/2 at 10 %: step 1/2 (10 %): pausing until 42 s from now"
    )
    rollout.state, rollout.message = res.ROLLOUT_STATE_ROLLED_BACK, "rolled back: aborted by a user"
    assert render.rollout_line(service(rollout=rollout)) == (
        "hello: canary rolled back: version 2 from 1: rolled back: aborted by a user"
    )
    assert render.rollout_line(service()) == ""
