"""The dashboard against a real controller (scripted provisioner, real prober), all in-process on
port 0: the page and its assets, the event stream (a snapshot, then every change as it happens),
the API token passed on to the controller, and the limits."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.cli import main as cli
from services.common import errors
from services.dashboard import server as dash_server
from tests.helpers import ports
from tests.service import test_controller as tc

TOKEN = "dashboard-test-token-0123456789"


@contextlib.asynccontextmanager
async def dashboard(controller_addr: str, **settings: object) -> AsyncIterator[dash_server.Running]:
    values: dict[str, object] = {
        "http_addr": "127.0.0.1:0",
        "listen_addr": "127.0.0.1:0",
        "controller_addr": controller_addr,
        "discover_interval_s": 0.1,
        "linger_s": 0.0,
        **settings,
    }
    running = await dash_server.start(dash_server.load_settings(environ={}, **values))
    try:
        yield running
    finally:
        await running.stop(None)


class Stream:
    """A page's event stream, read the way a browser reads it."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def next(self, timeout: float = 10.0) -> tuple[str, dict[str, Any]]:
        kind, data = "message", []
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.resp.content.readline()
                if not raw:
                    raise EOFError("the stream ended")
                line = raw.decode().rstrip("\n")
                if line == "":
                    if data:
                        return kind, json.loads("\n".join(data))
                    continue
                if line.startswith(":"):
                    continue
                field, _, value = line.partition(": ")
                if field == "event":
                    kind = value
                elif field == "data":
                    data.append(value)

    async def until(self, pred, timeout: float = 20.0) -> tuple[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
        async with asyncio.timeout(timeout):
            while True:
                kind, data = await self.next(timeout)
                if pred(kind, data):
                    return kind, data


@contextlib.asynccontextmanager
async def events(url: str, token: str | None = None) -> AsyncIterator[Stream]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(f"{url}api/events", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == "text/event-stream"
        yield Stream(resp)


def ready_row(service: str):  # type: ignore[no-untyped-def]
    def pred(kind: str, data: dict[str, Any]) -> bool:
        return kind == "change" and any(
            r["service"] == service and r["status"] == "READY" and r["removed"] is None for r in data["replicas"]
        )

    return pred


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


async def test_a_page_gets_a_snapshot_then_every_change_as_it_happens(env: tc.Env) -> None:
    await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("old")))
    async with dashboard(env.addr) as dash, events(dash.url) as stream:
        kind, snap = await stream.next()
        assert kind == "snapshot"
        assert snap["connection"]["state"] == "live"
        if not snap["services"]:  # the first listing had not brought its watch yet
            await stream.until(lambda k, d: k == "change" and d["service"] and d["service"]["name"] == "old")

        # Created after the page opened: found by the listing, then followed on its watch.
        await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("fresh")))
        _, change = await stream.until(ready_row("fresh"))
        (row,) = [r for r in change["replicas"] if r["service"] == "fresh"]
        assert row["endpoint"].startswith("http://")
        assert [h["status"] for h in row["history"]][-1] == "READY"
        assert any(h["status"] == "STARTING" for h in row["history"])
        texts = [e["text"] for e in change["events"]]
        assert any(t.startswith("fresh: replica 1 READY at http://") for t in texts), texts

        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="fresh"))
        _, gone = await stream.until(lambda k, d: k == "change" and d["deleted"] == "fresh")
        assert gone["events"][-1]["text"] == "fresh: deleted"

    # A page opened now finds the history the bridge kept (it lingers only while pages are open,
    # so this is a new bridge: the timeline comes from the replicas' own timestamps).
    async with dashboard(env.addr) as dash, events(dash.url) as stream:
        kind, snap = await stream.next()
        rows = [r for r in snap["replicas"] if r["service"] == "old"]
        while not rows:
            _, change = await stream.next()
            rows = [r for r in change["replicas"] if r["service"] == "old"]
        assert rows[0]["history"][0]["inferred"] is True


async def test_pages_with_one_token_share_one_set_of_streams(env: tc.Env) -> None:
    async with dashboard(env.addr, linger_s=30.0) as dash:
        async with events(dash.url) as first, events(dash.url) as second:
            assert (await first.next())[0] == "snapshot"
            assert (await second.next())[0] == "snapshot"
            assert len(dash.bridges._bridges) == 1
            assert dash.bridges.clients == 2
            await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("both")))
            seen = []
            for stream in (first, second):
                _, change = await stream.until(ready_row("both"))
                seen += [r for r in change["replicas"] if r["service"] == "both"]
            assert seen[0] == seen[1], "both pages got the same change"
        # Kept warm a while for a reload, with what it saw.
        for _ in range(100):
            if dash.bridges.clients == 0:
                break
            await asyncio.sleep(0.05)
        assert dash.bridges.clients == 0 and len(dash.bridges._bridges) == 1
        async with events(dash.url) as again:
            _, snap = await again.next()
            (row,) = [r for r in snap["replicas"] if r["service"] == "both"]
            assert row["history"] == seen[0]["history"], "the history it kept"


async def test_a_page_that_falls_behind_gets_a_fresh_snapshot_instead_of_a_backlog(env: tc.Env) -> None:
    async with dashboard(env.addr) as dash, events(dash.url) as stream:
        await stream.next()
        (bridge,) = dash.bridges._bridges.values()
        (sub,) = bridge.subscribers
        sub.limit = 0  # every message overflows the queue
        await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("busy", replicas=3)))
        _, data = await stream.until(lambda k, d: k == "snapshot" and d["services"])
        assert [s["name"] for s in data["services"]] == ["busy"]


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("", "the controller requires an API token"),
        ("Bearer wrong-token-wrong-token", "the controller did not accept this API token"),
        ("Basic dXNlcjpwYXNz", "the Authorization header must be `Bearer <token>`"),
        (f"Bearer {TOKEN}\u00e9", "the Authorization header must be `Bearer <token>`"),
    ],
)
async def test_the_controller_decides_about_the_token_and_a_refusal_is_401(
    tmp_path, caplog, header: str, message: str
) -> None:
    caplog.set_level(logging.DEBUG)
    async with tc.started(tmp_path, auth_token=TOKEN) as env, dashboard(env.addr) as dash:
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": header} if header else {}
            async with session.get(f"{dash.url}api/events", headers=headers) as resp:
                assert resp.status == 401
                body = await resp.json()
        assert body == {"error": message}
        assert dash.bridges.clients == 0
        for _ in range(50):
            if not dash.bridges._bridges:
                break
            await asyncio.sleep(0.02)
        assert not dash.bridges._bridges, "a refused token keeps no streams open"
    assert "wrong-token" not in caplog.text and TOKEN not in caplog.text


async def test_with_the_right_token_the_page_sees_the_fleet(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    async with tc.started(tmp_path, auth_token=TOKEN) as env, dashboard(env.addr) as dash:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("secret")), metadata=auth)
        async with events(dash.url, TOKEN) as stream:
            kind, snap = await stream.next()
            assert (kind, snap["connection"]["state"]) == ("snapshot", "live")
            await stream.until(ready_row("secret"))
    assert TOKEN not in caplog.text


async def test_a_token_the_controller_stops_accepting_ends_the_page_with_denied(tmp_path) -> None:
    # The controller restarts on its address with a token required: the open page is told, and
    # its stream ends (it does not keep showing the fleet).
    host = ports.private_host()
    first = contextlib.AsyncExitStack()
    env = await first.enter_async_context(tc.started(tmp_path, listen_addr=f"{host}:0"))
    try:
        port = int(env.addr.rpartition(":")[2])
        async with dashboard(f"{host}:{port}") as dash, events(dash.url) as stream:
            assert (await stream.next())[1]["connection"]["state"] == "live"
            await first.aclose()
            async with tc.started(tmp_path / "again", listen_addr=f"{host}:{port}", auth_token=TOKEN):
                _, denied = await stream.until(lambda k, d: k == "denied", timeout=30)
                assert denied["message"] == "the controller requires an API token"
                with pytest.raises(EOFError):
                    await stream.next(timeout=10)
    finally:
        await first.aclose()


async def test_more_pages_than_allowed_get_503(env: tc.Env) -> None:
    async with dashboard(env.addr, max_pages=1) as dash, events(dash.url) as stream:
        await stream.next()
        async with aiohttp.ClientSession() as session, session.get(f"{dash.url}api/events") as resp:
            assert resp.status == 503
            assert "too many dashboard pages" in (await resp.json())["error"]


async def test_a_controller_that_is_away_is_shown_not_hidden() -> None:
    with ports.Reserved() as reserved:
        async with dashboard(reserved.addr, call_timeout_s=1.0) as dash, events(dash.url) as stream:
            kind, snap = await stream.next()
            if snap["connection"]["state"] == "starting":
                kind, snap = await stream.until(lambda k, d: k == "connection")
            state = snap["connection"]["state"] if kind == "snapshot" else snap["state"]
            assert state == "unreachable"


async def test_page_assets_and_headers(env: tc.Env) -> None:
    async with dashboard(env.addr) as dash, aiohttp.ClientSession() as session:
        for path, content_type in [("", "text/html"), ("app.js", "text/javascript"), ("style.css", "text/css")]:
            async with session.get(f"{dash.url}{path}") as resp:
                assert resp.status == 200, path
                assert resp.content_type == content_type
                csp = resp.headers["Content-Security-Policy"]
                assert "script-src 'self'" in csp and "default-src 'none'" in csp
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
        async with session.get(f"{dash.url}healthz") as resp:
            assert (resp.status, (await resp.json())["status"]) == (200, "ok")
        # Read-only: nothing but GET.
        for method in ("POST", "PUT", "DELETE"):
            async with session.request(method, f"{dash.url}api/events") as resp:
                assert resp.status == 405, method
        async with session.get(f"{dash.url}nothing-here") as resp:
            assert resp.status == 404
            assert "Content-Security-Policy" in resp.headers
        # A DNS name pointed at loopback by another site (rebinding) is refused; IPs and localhost are not.
        for host, status in [("evil.example", 421), ("localhost:1", 200), ("[::1]:1", 200), ("127.0.0.1", 200)]:
            async with session.get(dash.url, headers={"Host": host}) as resp:
                assert resp.status == status, host
    async with (
        dashboard(env.addr, allowed_hosts=("dash.example",)) as dash,
        aiohttp.ClientSession() as session,
        session.get(dash.url, headers={"Host": "dash.example:8080"}) as resp,
    ):
        assert resp.status == 200


async def test_health_check_answers_serving(env: tc.Env) -> None:
    async with dashboard(env.addr) as dash:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{dash.built.port}") as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_settings_name_every_bad_value() -> None:
    with pytest.raises(errors.ValidationError) as err:
        dash_server.load_settings(
            environ={}, http_addr="nowhere", discover_interval_s=0, max_pages=0, linger_s=-1, controller_addr="x"
        )
    assert [v.field for v in err.value.violations] == [
        "dashboard.http_addr",
        "dashboard.controller_addr",
        "dashboard.discover_interval_s",
        "dashboard.linger_s",
        "dashboard.max_pages",
    ]
    settings = dash_server.load_settings(environ={"REPLICAPLANE_DASHBOARD_ALLOWED_HOSTS": "a.example, b.example"})
    assert settings.allowed_hosts == ("a.example", "b.example")


# --- replicactl dashboard -------------------------------------------------------------------


def write_stack_state(state_dir, url: str) -> None:  # type: ignore[no-untyped-def]
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {"pid": 1, "processes": [{"name": "dashboard", "pid": 1, "addr": "127.0.0.1:1", "url": url}]}
    (state_dir / "stack.json").write_text(json.dumps(state))


async def replicactl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}, clear=False):
        for var in ("REPLICAPLANE_DASHBOARD_URL", "REPLICAPLANE_API_TOKEN", "REPLICAPLANE_API_TOKEN_FILE"):
            if var not in (env or {}):
                os.environ.pop(var, None)
        code = await asyncio.to_thread(cli.run, list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


async def test_replicactl_dashboard_prints_the_url_of_the_running_stack(env: tc.Env, tmp_path) -> None:
    async with dashboard(env.addr) as dash:
        base = dash.url.rstrip("/")
        write_stack_state(tmp_path / "st", base)
        code, out, err = await replicactl("dashboard", "--state-dir", str(tmp_path / "st"))
        assert (code, out, err) == (0, f"{base}/\n", "")
        # --url and $REPLICAPLANE_DASHBOARD_URL come first.
        code, out, _ = await replicactl("dashboard", "--state-dir", str(tmp_path / "none"), "--url", dash.url)
        assert (code, out) == (0, dash.url + "\n")
        code, out, _ = await replicactl(
            "dashboard", "--state-dir", str(tmp_path / "none"), env={"REPLICAPLANE_DASHBOARD_URL": base}
        )
        assert (code, out) == (0, f"{base}/\n")


async def test_replicactl_dashboard_open_hands_the_token_to_the_page_in_the_fragment(env: tc.Env, tmp_path) -> None:
    opened: list[str] = []
    async with dashboard(env.addr) as dash:
        with mock.patch("webbrowser.open", side_effect=lambda url, *a, **k: opened.append(url) or True):
            code, out, err = await replicactl(
                "dashboard", "--url", dash.url, "--open", env={"REPLICAPLANE_API_TOKEN": "tok/en+with space"}
            )
    assert code == 0, err
    assert opened == [f"{dash.url}#token=tok%2Fen%2Bwith%20space"]
    assert "tok" not in out and "tok" not in err, "the token is never printed"
    assert dash.url in out


async def test_replicactl_dashboard_open_hands_the_stacks_token_only_to_its_running_dashboard(
    env: tc.Env, tmp_path
) -> None:
    token_file = tmp_path / "api-token"
    token_file.write_text("generated-stack-token-0123456789\n")
    opened: list[str] = []

    async def open_page(*args: str, pid: int, user_env: dict[str, str] | None = None) -> str:
        state = {
            "pid": os.getpid(),
            "controller": env.addr,
            "token_file": str(token_file),
            "processes": [{"name": "dashboard", "pid": pid, "addr": "unix:/x.sock", "url": base}],
        }
        (tmp_path / "st").mkdir(exist_ok=True)
        (tmp_path / "st" / "stack.json").write_text(json.dumps(state))
        opened.clear()
        with mock.patch("webbrowser.open", side_effect=lambda url, *a, **k: opened.append(url) or True):
            code, out, err = await replicactl("dashboard", "--state-dir", str(tmp_path / "st"), *args, env=user_env)
        assert code == 0, err
        assert "generated-stack" not in out + err, "the token is never printed"
        return opened[0]

    async with dashboard(env.addr) as dash:
        base = dash.url.rstrip("/")
        # The stack's own dashboard, running: the token the stack generated goes to the page.
        assert await open_page("--open", pid=os.getpid()) == f"{base}/#token=generated-stack-token-0123456789"
        # Another URL (here another name for the same server) gets no token of the stack's.
        other = base.replace("127.0.0.1", "localhost")
        assert await open_page("--open", "--url", other, pid=os.getpid()) == f"{other}/"
        # The recorded dashboard is gone: whoever answers on its port now may be anyone.
        gone = await asyncio.create_subprocess_exec("true")
        await gone.wait()
        assert await open_page("--open", pid=gone.pid) == f"{base}/"
        # No stack recorded: the default address gets no token, not even the user's own.
        (tmp_path / "st" / "stack.json").unlink()
        opened.clear()
        user_env = {
            "REPLICAPLANE_API_TOKEN": "users-own-token-0123456789",
            "REPLICAPLANE_DASHBOARD_HTTP_ADDR": base[7:],
        }
        with mock.patch("webbrowser.open", side_effect=lambda url, *a, **k: opened.append(url) or True):
            code, _, err = await replicactl("dashboard", "--state-dir", str(tmp_path / "st"), "--open", env=user_env)
        assert (code, opened) == (0, [f"{base}/"]), err


async def test_replicactl_dashboard_says_when_nothing_answers(tmp_path) -> None:
    with ports.Reserved() as dead:
        code, out, err = await replicactl("dashboard", "--url", dead.url)
    assert code == 4
    assert out == f"{dead.url}/\n"
    assert "nothing answers" in err and "make up" in err
