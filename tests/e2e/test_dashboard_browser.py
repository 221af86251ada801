"""The web dashboard in a real browser (headless Chromium over the DevTools protocol) against a
live local stack whose controller requires an API token: the page asks for the token, takes it
from the URL fragment, and shows a service's replicas going READY as it happens, without a
reload. A screenshot is saved (and kept in $REPLICAPLANE_TEST_ARTIFACTS when set)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc
from services.common import specfile
from tests.e2e import test_stack as st
from tests.helpers import browser

pytestmark = pytest.mark.e2e

# Chromium runs as root in CI containers, and `--no-sandbox` is only for that.
_NO_CHROMIUM = "no Chromium: install Debian's `chromium` package (`apt-get install -y chromium`; .ci/run does)"

READY_ROWS = 'document.querySelectorAll(\'#replicas tr[data-service="hello"][data-status="READY"]\').length'


@pytest.fixture
def state_dir(tmp_path):  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    yield state
    if (state / "stack.json").exists() or (state / "stack.pid").exists():
        st.stack("down", "--state-dir", str(state), env=dict(os.environ), timeout=200)


@pytest.mark.skipif(browser.find() is None, reason=_NO_CHROMIUM)
async def test_the_page_shows_replicas_going_ready_live_without_a_reload(state_dir, tmp_path) -> None:
    token = secrets.token_hex(16)
    env = {**st.stack_env(), "REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token}
    env.pop("REPLICAPLANE_API_TOKEN", None)
    up = st.stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=240)
    assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{st.logs(state_dir)}"
    state = json.loads((state_dir / "stack.json").read_text())
    url = next(p["url"] for p in state["processes"] if p["name"] == "dashboard") + "/"
    assert f"dashboard at {url}" in up.stdout, up.stdout
    assert token not in up.stdout

    async with browser.chromium(str(tmp_path)) as page:
        # Without a token, the controller says no and the page asks for one.
        await page.navigate(url)
        await page.wait_for("document.getElementById('connection').dataset.state === 'denied'")
        assert await page.evaluate("!document.getElementById('token-panel').hidden")
        message = await page.evaluate("document.getElementById('token-message').textContent")
        assert message == "the controller requires an API token"

        # `replicactl dashboard --open` hands the token over in the fragment, which no server sees.
        await page.navigate(f"{url}#token={token}")
        await page.wait_for("document.getElementById('connection').dataset.state === 'live'")
        assert await page.evaluate("location.hash") == "", "the token left the address bar"
        assert await page.evaluate("sessionStorage.getItem('replicaplane.dashboard.token')") == token
        assert await page.evaluate("document.getElementById('services-empty').hidden") is False
        loads = page.navigations
        await page.evaluate("window.stillTheSamePage = true")  # gone if anything reloads the page

        # The service is created after the page opened; everything after arrives on the stream.
        # Its app takes a few seconds to start, so the page shows each replica STARTING first.
        text = specfile.read_spec(st.EXAMPLE).replace("run: python3 app.py", "run: sleep 3 && exec python3 app.py")
        assert "sleep 3" in text
        with grpc.insecure_channel(state["controller"]) as channel:
            stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
            stub.CreateService(
                pb.CreateServiceRequest(yaml=text), timeout=30, metadata=(("authorization", f"Bearer {token}"),)
            )
        starting = READY_ROWS.replace("READY", "STARTING")
        try:
            await page.wait_for(f"{starting} >= 1", timeout=60)
            await page.wait_for(f"{READY_ROWS} === 2", timeout=120)
        except browser.PageError:
            pytest.fail(f"no READY rows on the page\n{st.logs(state_dir)}")
        assert await page.evaluate("window.stillTheSamePage") is True
        assert page.navigations == loads, "no navigation or reload happened"

        # Services table, timeline and events all show it.
        assert await page.evaluate("document.querySelector('#services tr[data-service=\"hello\"]').dataset.status")
        await page.wait_for("document.querySelector('#services tr[data-service=\"hello\"]').dataset.status === 'READY'")
        endpoints = await page.evaluate(
            "[...document.querySelectorAll('#replicas tr[data-service=\"hello\"] a')].map(a => a.href)"
        )
        assert len(endpoints) == 2 and all(e.startswith("http://") for e in endpoints), endpoints
        timeline = await page.evaluate(
            "[...document.querySelectorAll('#timeline .tl-bar')].map(bar => "
            "[...bar.querySelectorAll('.tl-seg')].map(s => s.dataset.status))"
        )
        assert len(timeline) == 2, timeline
        for statuses in timeline:
            assert statuses[-2:] == ["STARTING", "READY"], timeline
        live = await page.evaluate(
            "[...document.querySelectorAll('#timeline .tl-seg[data-status=\"READY\"]')]"
            ".filter(s => !s.classList.contains('inferred')).length"
        )
        assert live == 2, "both READY segments were seen as they happened, not inferred"
        events = await page.evaluate("[...document.querySelectorAll('#events li')].map(li => li.textContent)")
        assert any("hello: replica 1 READY at http://" in e for e in events), events
        assert any("hello: service READY" in e for e in events), events
        summary = await page.evaluate("document.getElementById('summary').textContent")
        assert summary == "1 service · 2/2 replicas ready"
        assert page.exceptions == [], page.exceptions

        await page.evaluate("new Promise(r => setTimeout(r, 1500))")  # let the timeline grow a little
        shot = await page.screenshot(str(tmp_path / "dashboard.png"))
        browser.keep_artifact(shot)
        print(f"screenshot: {shot}", file=sys.stderr)
    png = await asyncio.to_thread((tmp_path / "dashboard.png").read_bytes)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    down = st.stack("down", "--state-dir", str(state_dir), env=env, timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}\n{st.logs(state_dir)}"
