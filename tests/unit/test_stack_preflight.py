"""What the stack checks before it starts anything: fixed ports free, and how a process that
stopped says why (from its log)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from services.stack import plan, preflight, procs

PICKED = {
    "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
    "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
    "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
}


@pytest.fixture
def held() -> Iterator[str]:
    """A loopback address this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def specs(**env: str) -> list[plan.ProcessSpec]:
    return plan.plan(state_dir="/tmp/rp-preflight", environ={**PICKED, **env})


def test_a_stack_on_picked_ports_needs_no_fixed_port() -> None:
    assert preflight.needs(specs()) == []
    assert preflight.check_ports(specs()) == ""


def test_default_ports_are_every_public_and_metrics_port() -> None:
    needs = preflight.needs(plan.plan(state_dir="/tmp/rp-preflight", environ={}))
    assert {(n.addr, n.setting) for n in needs} == {
        ("127.0.0.1:50051", "REPLICAPLANE_CONTROLLER_LISTEN_ADDR"),
        ("127.0.0.1:30001", "REPLICAPLANE_LOADBALANCER_HTTP_ADDR"),
        ("127.0.0.1:30080", "REPLICAPLANE_DASHBOARD_HTTP_ADDR"),
        ("127.0.0.1:9451", "REPLICAPLANE_CONTROLLER_METRICS_ADDR"),
        ("127.0.0.1:9452", "REPLICAPLANE_PROVISIONER_METRICS_ADDR"),
        ("127.0.0.1:9453", "REPLICAPLANE_PROBER_METRICS_ADDR"),
        ("127.0.0.1:9454", "REPLICAPLANE_LOADBALANCER_METRICS_ADDR"),
        ("127.0.0.1:9459", "REPLICAPLANE_DASHBOARD_METRICS_ADDR"),
    }  # the internal services are on Unix sockets: nothing to check


def test_a_taken_port_is_named_with_its_setting_and_holder(held: str) -> None:
    problem = preflight.check_ports(specs(REPLICAPLANE_LOADBALANCER_HTTP_ADDR=held))
    assert problem.startswith(
        f"{held} (REPLICAPLANE_LOADBALANCER_HTTP_ADDR, loadbalancer HTTP) is in use by pid {os.getpid()} ("
    )
    assert problem.endswith("set REPLICAPLANE_LOADBALANCER_HTTP_ADDR to a free address (port 0 picks one)")
    assert "\n" not in problem


def test_two_settings_on_one_port_are_named(held: str) -> None:
    port = held.rpartition(":")[2]
    problem = preflight.check_ports(
        specs(REPLICAPLANE_DASHBOARD_HTTP_ADDR=f"0.0.0.0:{port}", REPLICAPLANE_LOADBALANCER_HTTP_ADDR=held)
    )
    assert f"REPLICAPLANE_DASHBOARD_HTTP_ADDR and REPLICAPLANE_LOADBALANCER_HTTP_ADDR both use port {port}" in problem


def test_an_address_of_another_host_is_named() -> None:
    problem = preflight.check_ports(specs(REPLICAPLANE_CONTROLLER_LISTEN_ADDR="192.0.2.1:50051"))
    assert problem.startswith(
        "192.0.2.1:50051 (REPLICAPLANE_CONTROLLER_LISTEN_ADDR, controller gRPC) is not an address"
    )


@pytest.mark.parametrize(
    ("a", "b", "clash"),
    [
        ("127.0.0.1:80", "127.0.0.1:80", True),
        ("0.0.0.0:80", "127.0.0.1:80", True),
        ("[::]:80", "127.0.0.2:80", True),
        ("127.0.0.1:80", "127.0.0.2:80", False),
        ("127.0.0.1:80", "127.0.0.1:81", False),
    ],
)
def test_overlapping_addresses(a: str, b: str, clash: bool) -> None:
    assert preflight._overlap(a, b) is clash


def write_log(tmp_path, text: str) -> str:
    path = tmp_path / "controller.log"
    path.write_text(text)
    return str(path)


def test_exit_reason_is_the_cannot_start_line(tmp_path) -> None:
    log = write_log(
        tmp_path,
        "--- 2026-01-01 10:00:00 starting controller\n"
        "2026-01-01 10:00:01,000 controller CRITICAL services.common.logs: cannot start: invalid controller "
        "settings: controller.max_replicas_total: REPLICAPLANE_CONTROLLER_MAX_REPLICAS_TOTAL: expected int, got 'x'\n",
    )
    assert procs.exit_reason(log) == (
        "invalid controller settings: controller.max_replicas_total: "
        "REPLICAPLANE_CONTROLLER_MAX_REPLICAS_TOTAL: expected int, got 'x'"
    )


def test_exit_reason_falls_back_to_a_tracebacks_last_line_of_this_run_only(tmp_path) -> None:
    log = write_log(
        tmp_path,
        "--- 2026-01-01 10:00:00 starting controller\n"
        "2026-01-01 10:00:01,000 controller CRITICAL services.common.logs: cannot start: an older run\n"
        "--- 2026-01-01 11:00:00 starting controller\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "sqlite3.OperationalError: database is locked\n",
    )
    assert procs.exit_reason(log) == "OperationalError: database is locked"


def test_exit_reason_is_empty_without_an_error(tmp_path) -> None:
    assert procs.exit_reason(write_log(tmp_path, "--- starting\nserving\nstopped\n")) == ""
    assert procs.exit_reason(str(tmp_path / "missing.log")) == ""
