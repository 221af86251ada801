"""`env_overrides` and `secret_overrides` through the real API (and replicactl's --env/--secret):
empty YAML values are filled before validation, secrets reach the replica's launch and are
redacted everywhere the spec is shown, bad keys are refused and change nothing."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.cli import main as cli
from services.common import grpc_errors
from tests.service.test_controller import Env, started

SECRET = "hf_0123456789abcdefSECRET"
YAML = (
    "name: llm\n"
    "service:\n"
    "  readiness_probe: /\n"
    "  replicas: 1\n"
    "resources:\n"
    "  ports: 8080\n"
    "envs:\n"
    "  MODEL:\n"
    "  KEEP: yes-kept\n"
    "secrets:\n"
    "  HF_TOKEN:\n"
    "run: serve $MODEL\n"
)


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[Env]:
    async with started(tmp_path) as e:
        yield e


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    decoded = grpc_errors.RpcError(err)
    return dict(decoded.field_violations)


async def shown_everywhere(env: Env, name: str) -> str:
    """Every place the API and replicactl show the spec, as one text."""
    parts = [str((await env.stub.GetService(api.GetServiceRequest(service_name=name))).service)]
    parts += [str(s) for s in (await env.stub.ListServices(api.ListServicesRequest())).services]
    watch = env.stub.WatchService(api.WatchServiceRequest(service_name=name))
    parts.append(str(await asyncio.wait_for(watch.read(), 10)))
    watch.cancel()
    for argv in (["status", "--json"], ["status", name, "--all"], ["status", name, "-v"]):
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(cli.run, ["--controller", env.addr, *argv], out=out, err=err)
        assert code == 0, err.getvalue()
        parts.append(out.getvalue() + err.getvalue())
    return "\n".join(parts)


async def test_empty_envs_and_secrets_are_refused_without_overrides(env: Env) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=YAML))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(violations(refused.value)) == {"envs.MODEL", "secrets.HF_TOKEN"}


async def test_overrides_fill_the_yaml_reach_the_launch_and_the_secret_is_never_shown(env: Env) -> None:
    request = api.CreateServiceRequest(
        yaml=YAML, env_overrides={"MODEL": "llama-3"}, secret_overrides={"HF_TOKEN": SECRET}
    )
    svc = (await env.stub.CreateService(request)).service
    assert svc.name == "llm"
    assert dict(svc.spec.envs) == {"MODEL": "llama-3", "KEEP": "yes-kept"}
    assert dict(svc.spec.secrets) == {"HF_TOKEN": "<redacted>"}

    for _ in range(200):
        if env.provisioner.specs:
            break
        await asyncio.sleep(0.05)
    launched = next(iter(env.provisioner.specs.values()))
    assert launched.secrets["HF_TOKEN"] == SECRET  # the replica gets the real value
    assert launched.envs["MODEL"] == "llama-3"

    shown = await shown_everywhere(env, "llm")
    assert SECRET not in shown
    assert "llama-3" in shown

    # An update must give the secret again: overrides are per request, as with `sky serve update`.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="llm", yaml=YAML, dry_run=True))
    assert set(violations(refused.value)) == {"envs.MODEL", "secrets.HF_TOKEN"}
    dry = await env.stub.UpdateService(
        api.UpdateServiceRequest(
            service_name="llm",
            yaml=YAML,
            dry_run=True,
            env_overrides={"MODEL": "llama-3"},
            secret_overrides={"HF_TOKEN": SECRET},
        )
    )
    assert dry.plan.in_place  # the same spec: nothing to relaunch
    assert SECRET not in str(dry)


async def test_a_bad_override_key_is_refused_and_changes_nothing(env: Env) -> None:
    request = api.CreateServiceRequest(
        yaml=YAML,
        env_overrides={"MODEL": "x", "1BAD": "y"},
        secret_overrides={"HF_TOKEN": SECRET, "bad-name": SECRET},
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await env.stub.CreateService(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(violations(refused.value)) == {"env_overrides.1BAD", "secret_overrides.bad-name"}
    assert SECRET not in str(refused.value.details())
    assert SECRET not in str(refused.value.trailing_metadata())
    assert not (await env.stub.ListServices(api.ListServicesRequest())).services


async def test_replicactl_up_sends_env_and_secret_flags(env: Env, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file = tmp_path / "task.yaml"
    spec_file.write_text(YAML)
    env_file = tmp_path / "vars.env"
    env_file.write_text("# model settings\nexport MODEL='from-file'\nKEEP=\"file kept\"\n")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out, err = io.StringIO(), io.StringIO()
    argv = ["--controller", env.addr, "up", str(spec_file), "--env-file", str(env_file), "--env", "MODEL=cli"]
    code = await asyncio.to_thread(cli.run, [*argv, "--secret", "HF_TOKEN"], out=out, err=err)
    assert code == 0, err.getvalue()
    assert "llm: created (version 1)" in out.getvalue()
    assert SECRET not in out.getvalue() + err.getvalue()
    doc = json.loads(await asyncio.to_thread(_status_json, env.addr, "llm"))
    spec = doc["services"][0]["spec"]
    assert spec["envs"] == {"MODEL": "cli", "KEEP": "file kept"}  # --env wins over --env-file
    assert spec["secrets"] == {"HF_TOKEN": "<redacted>"}

    monkeypatch.delenv("HF_TOKEN")
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        cli.run, ["--controller", env.addr, "update", "llm", str(spec_file), "--secret", "HF_TOKEN"], out=out, err=err
    )
    assert code == cli.BAD_INPUT
    assert (
        err.getvalue() == "error: --secret HF_TOKEN: HF_TOKEN is not set in your environment (or give HF_TOKEN=VALUE)\n"
    )


def _status_json(addr: str, name: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert cli.run(["--controller", addr, "status", name, "--json"], out=out, err=err) == 0, err.getvalue()
    return out.getvalue()
