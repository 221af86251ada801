"""Secret and probe header values never leave the controller, however the YAML spells them.

Each case writes the values in one YAML string style (plain, quoted with escapes, block
scalars with chomping indicators) and reads every place that shows a spec: the API's
responses and watch, and `replicactl status --json`.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import yaml

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.cli import main as cli
from services.common import spec as spec_mod
from tests.service.test_controller import Env, started

# A style renders two fragments as the text after `KEY: ` at a given indent; the value YAML
# reads keeps both fragments, but never as one run of characters the raw text also holds.
Style = Callable[[str, str, str], str]

STYLES: dict[str, Style] = {
    "plain": lambda a, b, ind: f"{a}-{b}",
    "plain over two lines": lambda a, b, ind: f"{a}\n{ind}  {b}",
    "single-quoted with ''": lambda a, b, ind: f"'{a}''{b}'",
    "double-quoted with \\u escape": lambda a, b, ind: f'"{a}\\u0032{b}"',
    "double-quoted with \\x escape": lambda a, b, ind: f'"{a}\\x41{b}"',
    "double-quoted line continuation": lambda a, b, ind: f'"{a}\\\n{ind}  {b}"',
    "literal |-": lambda a, b, ind: f"|-\n{ind}  {a}{b}",
    "literal with indentation indicator |2-": lambda a, b, ind: f"|2-\n{ind}  {a}{b}",
    "folded >-": lambda a, b, ind: f">-\n{ind}  {a}\n{ind}  {b}",
    # Header values cannot hold a line break, so these keep a newline only in secrets.
    "literal |": lambda a, b, ind: f"|\n{ind}  {a}\n{ind}  {b}\n",
    "literal |+": lambda a, b, ind: f"|+\n{ind}  {a}\n{ind}  {b}\n\n",
    "folded >": lambda a, b, ind: f">\n{ind}  {a}\n{ind}  {b}\n",
    "folded >+": lambda a, b, ind: f">+\n{ind}  {a}\n\n{ind}  {b}\n",
}
MULTILINE = {"literal |", "literal |+", "folded >", "folded >+"}


def _yaml(secret: str, header: str, plain: str = "p-plain-secret") -> str:
    return (
        "name: sec\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    headers:\n"
        f"      X-Api-Key: {header}\n"
        "      Authorization: Bearer ${PLAIN}\n"
        "  replicas: 1\n"
        "resources:\n"
        "  ports: 8080\n"
        "secrets:\n"
        f"  TOKEN: {secret}\n"
        f"  PLAIN: {plain}\n"
        "run: serve\n"
    )


def _fragments() -> tuple[str, str]:
    return f"s{uuid.uuid4().hex[:12]}", f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[Env]:
    async with started(tmp_path) as e:
        yield e


async def _everything_shown(env: Env, name: str, yaml_text: str) -> tuple[str, list[str]]:
    """Every place a spec is shown, as text; and the `spec.yaml` strings among them."""
    shown: list[str] = []
    yamls: list[str] = []

    def keep(svc: object) -> None:
        shown.append(str(svc))
        yamls.append(svc.spec.yaml)  # type: ignore[attr-defined]

    created = await env.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    keep(created.service)
    keep((await env.stub.GetService(api.GetServiceRequest(service_name=name))).service)
    for svc in (await env.stub.ListServices(api.ListServicesRequest())).services:
        keep(svc)
    watch = env.stub.WatchService(api.WatchServiceRequest(service_name=name))
    first = await asyncio.wait_for(watch.read(), 10)
    watch.cancel()
    keep(first.service)
    dry = await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name=name, yaml=yaml_text.replace("replicas: 1", "replicas: 2"), dry_run=True)
    )
    keep(dry.service)
    shown.append(str(dry.plan))
    for argv in (["status", "--json"], ["status", name, "--json"], ["status", name, "--all"]):
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(cli.run, ["--controller", env.addr, *argv], out=out, err=err)
        assert code == 0, err.getvalue()
        shown.append(out.getvalue() + err.getvalue())
    return "\n".join(shown), yamls


@pytest.mark.parametrize("style", list(STYLES))
async def test_no_yaml_string_style_shows_a_secret_or_header_value(env: Env, style: str) -> None:
    s1, s2 = _fragments()
    h1, h2 = _fragments()
    plain = f"p{uuid.uuid4().hex}"
    header_style = "plain" if style in MULTILINE else style
    yaml_text = _yaml(STYLES[style](s1, s2, "  "), STYLES[header_style](h1, h2, "      "), plain)
    parsed = spec_mod.parse(yaml_text)
    assert s1 in parsed.secrets["TOKEN"] and s2 in parsed.secrets["TOKEN"]
    assert h1 in parsed.service.readiness_probe.headers["X-Api-Key"]

    shown, yamls = await _everything_shown(env, "sec", yaml_text)

    for fragment in (s1, s2, h1, h2, plain):
        assert fragment not in shown, (style, fragment)
    # The YAML is still shown: the user's document, with the values replaced.
    for text in yamls:
        doc = yaml.safe_load(text)
        assert doc["secrets"] == {"TOKEN": spec_mod.REDACTED, "PLAIN": spec_mod.REDACTED}
        headers = doc["service"]["readiness_probe"]["headers"]
        assert headers == {"X-Api-Key": spec_mod.REDACTED, "Authorization": spec_mod.REDACTED}
        assert doc["run"] == "serve" and doc["service"]["replicas"] in (1, 2)


async def test_a_secret_spelled_differently_elsewhere_is_not_shown(env: Env) -> None:
    s1, s2 = _fragments()
    secret = f"{s1}2{s2}"
    # The same value as an env (escaped), a file mount key and a probe path (via ${TOKEN}),
    # reached through an anchor too.
    yaml_text = _yaml("*tok", f"&tok {secret}") + (
        f'envs:\n  COPY: "{s1}\\u0032{s2}"\n  ALSO: >-\n    x {s1}2{s2}\n'
        f'file_mounts:\n  "/data/{s1}\\u0032{s2}": /tmp\n'
    )
    yaml_text = yaml_text.replace("path: /health", "path: /health/${TOKEN}")
    shown, yamls = await _everything_shown(env, "sec", yaml_text)
    assert s1 not in shown and s2 not in shown
    doc = yaml.safe_load(yamls[0])
    assert doc["envs"] == {"COPY": spec_mod.REDACTED, "ALSO": f"x {spec_mod.REDACTED}"}
    assert doc["service"]["readiness_probe"]["path"] == "/health/${TOKEN}"
