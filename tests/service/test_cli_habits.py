"""replicactl's `sky serve` habits against a real controller (a scripted provisioner behind it):
generated names, several names, --endpoint, down A B / --all / -y, logs by position and
--sync-down."""

from __future__ import annotations

import asyncio
import io
import os
import pathlib
import re
from collections.abc import AsyncIterator

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.cli import main as cli
from tests.service.test_controller import Env, started

NAMELESS = "service:\n  readiness_probe: /\n  replicas: 1\nresources:\n  ports: 8080\nrun: serve\n"


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[Env]:
    async with started(tmp_path) as e:
        yield e


class Terminal(io.StringIO):
    """A stdin that says it is a terminal, with the user's answers."""

    def isatty(self) -> bool:
        return True


async def ctl(env: Env, *argv: str, stdin: io.StringIO | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        cli.run, ["--controller", env.addr, *argv], out=out, err=err, stdin=stdin or io.StringIO()
    )
    return code, out.getvalue(), err.getvalue()


async def names(env: Env) -> list[str]:
    return [s.name for s in (await env.stub.ListServices(api.ListServicesRequest())).services]


async def create(env: Env, name: str) -> None:
    await env.stub.CreateService(api.CreateServiceRequest(service_name=name, yaml=NAMELESS))


async def test_up_without_a_name_generates_one_and_prints_it(env: Env, tmp_path) -> None:
    spec = tmp_path / "task.yaml"
    spec.write_text(NAMELESS)
    code, out, err = await ctl(env, "up", str(spec))
    assert code == cli.OK, err
    name = re.search(r"^(service-[a-z]+-[0-9a-f]{4}): created \(version 1\)$", out, re.MULTILINE)
    assert name, out
    assert out.startswith(f"no -n NAME and no name: in the YAML: naming the service {name[1]}\n")
    code, again, _ = await ctl(env, "up", str(spec))
    assert code == cli.OK
    second = re.search(r"^(service-[a-z]+-[0-9a-f]{4}): created", again, re.MULTILINE)
    assert second and second[1] != name[1]
    assert sorted(await names(env)) == sorted([name[1], second[1]])
    # A name given, or one in the YAML, is used as it is.
    code, out, _ = await ctl(env, "up", str(spec), "-n", "given")
    assert (code, out) == (cli.OK, "given: created (version 1)\n")


async def test_status_of_several_names_and_the_endpoint_alone(env: Env) -> None:
    for name in ("alpha", "beta", "gamma"):
        await create(env, name)
    code, out, _ = await ctl(env, "status", "gamma", "alpha")
    assert code == cli.OK
    rows = [line.split()[0] for line in out.split("\n\n")[0].splitlines()[2:]]
    assert rows == ["gamma", "alpha"]
    code, out, err = await ctl(env, "status", "alpha", "nope")
    assert code == cli.NOT_FOUND and "alpha" in out and err == "error: service 'nope' not found\n"

    code, _, err = await ctl(env, "status", "--endpoint", "alpha")
    assert (code, err) == (cli.REFUSED, "error: alpha has no URL yet: no load balancer has reported for it\n")
    report = api.ReportLoadRequest(service_name="alpha", load_balancer_url="http://127.0.0.1:30005")
    await env.stub.ReportLoad(report)
    assert await ctl(env, "status", "--endpoint", "alpha") == (cli.OK, "http://127.0.0.1:30005\n", "")
    code, _, err = await ctl(env, "status", "--endpoint", "alpha", "beta")
    assert (code, err) == (cli.BAD_INPUT, "error: --endpoint takes exactly one service name\n")


async def test_down_several_all_and_the_confirmation(env: Env) -> None:
    for name in ("a1", "a2", "a3", "a4"):
        await create(env, name)
    code, out, err = await ctl(env, "down", "a1", "nope", "a2")
    assert code == cli.NOT_FOUND, out + err
    assert "a1: SHUTTING_DOWN" in out and "a2: SHUTTING_DOWN" in out
    assert err == "error: service 'nope' not found\n"

    # On a terminal it asks; "n" changes nothing.
    code, out, _ = await ctl(env, "down", "a3", stdin=Terminal("n\n"))
    assert code == cli.REFUSED
    assert out == "Delete a3 and tear down every replica? [y/N] Aborted: nothing changed.\n"
    code, out, _ = await ctl(env, "down", "a3", "--wait", stdin=Terminal("y\n"))
    assert code == cli.OK and "a3: deleted" in out

    # In a script, --all needs -y.
    code, _, err = await ctl(env, "down", "--all")
    assert (code, err) == (cli.BAD_INPUT, "error: down --all deletes every service: add -y to confirm\n")
    assert "a4" in await names(env)
    code, out, err = await ctl(env, "down", "--all", "-y", "--wait", "--timeout", "30")
    assert code == cli.OK, err
    assert "a4: deleted" in out
    assert await names(env) == []
    assert await ctl(env, "down", "--all", "-y") == (cli.OK, "No services to delete.\n", "")
    code, _, err = await ctl(env, "down")
    assert (code, err) == (cli.BAD_INPUT, "error: name the services to delete (or --all)\n")


async def test_logs_by_position_and_sync_down_to_a_folder(env: Env, tmp_path) -> None:
    await create(env, "web")
    for _ in range(200):
        if env.provisioner.running:
            break
        await asyncio.sleep(0.05)
    replica_name = next(iter(env.provisioner.running))
    code, out, _ = await ctl(env, "logs", "web", "1", "--no-follow")
    assert (code, out) == (cli.OK, f"LOG_KIND_APP of {replica_name}\n")
    code, out, _ = await ctl(env, "logs", "web", "1")  # follows by default
    assert (code, out) == (cli.OK, f"LOG_KIND_APP of {replica_name}\nmore\n")
    code, out, _ = await ctl(env, "logs", "web", "1", "--launch", "--no-follow")
    assert out == f"LOG_KIND_LAUNCH of {replica_name}\n"
    code, _, err = await ctl(env, "logs", "web")
    assert code == cli.BAD_INPUT and "give a REPLICA_ID, --controller or --load-balancer" in err

    state = tmp_path / "no-stack"
    code, _, err = await ctl(env, "logs", "web", "--controller", "--state-dir", str(state))
    assert code == cli.NOT_FOUND
    assert err.startswith(f"error: no controller log in {state}: replicactl reads the local stack's logs")

    code, out, err = await ctl(
        env, "logs", "web", "--sync-down", "--dir", str(tmp_path / "out"), "--state-dir", str(state)
    )
    assert code == cli.OK, err
    folder = re.search(r"written to (\S+)", out)[1]  # type: ignore[index]
    assert folder.startswith(str(tmp_path / "out" / "web-"))
    assert sorted(os.listdir(folder)) == ["replica-1.launch.log", "replica-1.log"]
    written = await asyncio.to_thread(pathlib.Path(folder, "replica-1.log").read_text)
    assert written == f"LOG_KIND_APP of {replica_name}\n"
    assert "note: no controller log in" in err and "note: no load balancer log in" in err


async def test_logs_with_a_state_dir_sends_that_stacks_generated_token(tmp_path, monkeypatch) -> None:
    token = "stack-generated-token-0123456789"
    async with started(tmp_path, auth_token=token) as env:
        state = tmp_path / "elsewhere"
        state.mkdir()
        (state / "api-token").write_text(f"{token}\n")
        (state / "stack.json").write_text(
            f'{{"controller": "{env.addr}", "token_file": "{state / "api-token"}", "processes": []}}'
        )
        for var in ("REPLICAPLANE_API_TOKEN", "REPLICAPLANE_API_TOKEN_FILE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.chdir(tmp_path)  # no ./.state here: the token comes from --state-dir's stack
        code, _, err = await ctl(env, "logs", "nope", "1", "--no-follow", "--state-dir", str(state))
        assert (code, err.strip()) == (3, "error: service 'nope' not found")
        # Without it, the controller refuses the call.
        code, _, err = await ctl(env, "logs", "nope", "1", "--no-follow")
        assert code == 6, err
