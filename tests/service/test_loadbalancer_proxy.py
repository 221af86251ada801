"""The balancer's HTTP proxy against real replica HTTP servers on port 0 (the endpoint set is fed
directly; following the controller is covered end to end in tests/e2e/test_loadbalancer.py)."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.loadbalancer import balancer as bal
from services.loadbalancer import policies, proxy
from tests.helpers.apps import lbapp


class Replicas:
    """Replica apps served in-process, each on its own port."""

    def __init__(self) -> None:
        self.runners: dict[int, web.AppRunner] = {}
        self.urls: dict[int, str] = {}

    async def start(self, rid: int) -> policies.Replica:
        runner = web.AppRunner(lbapp.make_app(str(rid)), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners[rid] = runner
        self.urls[rid] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return policies.Replica(replica_id=rid, url=self.urls[rid])

    async def stop(self, rid: int) -> None:
        await self.runners.pop(rid).cleanup()

    async def close(self) -> None:
        for rid in list(self.runners):
            await self.stop(rid)


class Front:
    """A balancer and its proxy on port 0, plus a client."""

    def __init__(self, b: bal.Balancer, px: proxy.Proxy, runner: web.AppRunner, port: int, scheme: str) -> None:
        self.balancer = b
        self.proxy = px
        self.runner = runner
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))


async def start_front(
    *, policy: str = "", config: bal.Config | None = None, ssl_context: ssl.SSLContext | None = None
) -> Front:
    b = bal.Balancer("web", hold_timeout_s=10.0, hold_max=5, policy_override=policy)
    b.configure(config or bal.Config())
    px = proxy.Proxy(b, proxy.ProxySettings(backoff_initial_s=0.01))
    runner, port = await proxy.start_http(px, "127.0.0.1", 0, ssl_context=ssl_context)
    return Front(b, px, runner, port, "https" if ssl_context else "http")


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    r = Replicas()
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    f = await start_front()
    try:
        yield f
    finally:
        await f.client.close()
        await proxy.stop_http(f.runner, f.proxy)


async def counters_drain(b: bal.Balancer) -> None:
    for _ in range(200):
        if not b.in_flight.counts:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"in-flight counts did not return to 0: {b.in_flight.counts}")


async def test_forwards_method_path_query_headers_and_body(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1)], version=1)
    async with front.client.put(
        front.url + "/echo/a/b?x=1&y=%20z", data=b"payload", headers={"X-Custom": "yes", "Cookie": "c=1"}
    ) as resp:
        assert resp.status == 200
        got = json.loads(await resp.read())
    assert got["method"] == "PUT"
    assert got["path"] == "/echo/a/b"
    assert got["raw_path"] == "/echo/a/b?x=1&y=%20z"
    assert got["body"] == "payload"
    assert got["headers"]["X-Custom"] == "yes"
    assert got["headers"]["Cookie"] == "c=1"
    assert got["headers"]["X-Forwarded-For"] == "127.0.0.1"
    assert got["headers"]["X-Forwarded-Host"] == front.url.removeprefix("http://")
    for method in ("DELETE", "PATCH", "OPTIONS"):
        async with front.client.request(method, front.url + "/echo") as resp:
            assert json.loads(await resp.read())["method"] == method
    assert front.balancer.unreported == 4  # each request counted once for the load report


async def test_upstream_http_errors_are_returned_as_is_and_not_retried(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1), await replicas.start(2)], version=1)
    async with front.client.post(front.url + "/status/500") as resp:
        assert resp.status == 500
        assert (await resp.text()).startswith("status 500 from replica")
    assert sum(front.balancer.in_flight.totals.values()) == 1
    await counters_drain(front.balancer)


async def test_no_ready_replica_is_503_with_a_clear_message(front: Front) -> None:
    async with front.client.get(front.url + "/whoami") as resp:
        assert resp.status == 503
        text = await resp.text()
    assert "no ready replica for service 'web'" in text
    assert resp.headers["Retry-After"] == "1"


async def test_transport_errors_are_retried_on_another_replica(front: Front, replicas: Replicas) -> None:
    live = await replicas.start(1)
    dead = await replicas.start(2)
    await replicas.stop(2)  # its port now refuses connections
    front.balancer.set_endpoints([live, dead], version=1)
    for _ in range(6):
        async with front.client.get(front.url + "/whoami") as resp:
            assert resp.status == 200
            assert await resp.text() == "replica 1\n"
    front.balancer.set_endpoints([dead], version=2)
    async with front.client.get(front.url + "/whoami") as resp:
        assert resp.status == 502
        assert "after 3 attempts" in await resp.text()
    await counters_drain(front.balancer)


async def test_least_load_spreads_concurrent_slow_requests_and_counts_return_to_zero(
    front: Front, replicas: Replicas
) -> None:
    front.balancer.set_endpoints([await replicas.start(i) for i in (1, 2, 3)], version=1)

    async def slow() -> str:
        async with front.client.get(front.url + "/slow?s=0.5") as resp:
            return await resp.text()

    tasks = [asyncio.create_task(slow()) for _ in range(9)]
    for _ in range(200):
        if sum(front.balancer.in_flight.counts.values()) == 9:
            break
        await asyncio.sleep(0.01)
    assert front.balancer.in_flight.counts == {1: 3, 2: 3, 3: 3}
    answers = collections.Counter(await asyncio.gather(*tasks))
    assert answers == {"replica 1\n": 3, "replica 2\n": 3, "replica 3\n": 3}
    # Errors and disconnects release their count too.
    async with front.client.get(front.url + "/status/503") as resp:
        assert resp.status == 503
    cut = asyncio.create_task(slow())
    await asyncio.sleep(0.2)
    cut.cancel()
    await asyncio.gather(cut, return_exceptions=True)
    await counters_drain(front.balancer)


async def test_round_robin_cycles_strictly(replicas: Replicas) -> None:
    f = await start_front(policy="round_robin")
    try:
        f.balancer.set_endpoints([await replicas.start(i) for i in (1, 2, 3)], version=1)
        seen = []
        for _ in range(9):
            async with f.client.get(f.url + "/whoami") as resp:
                seen.append((await resp.text()).split()[1])
        assert sorted(seen[:3]) == ["1", "2", "3"]
        assert seen == seen[:3] * 3
    finally:
        await f.client.close()
        await proxy.stop_http(f.runner, f.proxy)


async def test_streaming_response_arrives_chunk_by_chunk(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1)], version=1)
    chunks = []
    async with front.client.get(front.url + "/stream?words=4&delay=0.3") as resp:
        assert resp.status == 200
        async for chunk in resp.content.iter_any():
            chunks.append(chunk.decode())
            if len(chunks) == 1:
                assert front.balancer.in_flight.get(1) == 1  # the replica is still writing
    assert chunks == ["word0 ", "word1 ", "word2 ", "word3 "]
    await counters_drain(front.balancer)


async def test_client_disconnect_stops_the_replicas_work(front: Front, replicas: Replicas, tmp_path) -> None:
    front.balancer.set_endpoints([await replicas.start(1)], version=1)
    marker = tmp_path / "work"
    resp = await front.client.get(f"{front.url}/work?ticks=200&delay=0.05&marker={marker}")
    await resp.content.readline()
    resp.close()  # the client goes away mid-stream
    for _ in range(200):
        if marker.exists():
            break
        await asyncio.sleep(0.02)
    state, ticks = marker.read_text().split()
    assert state == "cancelled"
    assert int(ticks) < 100
    await counters_drain(front.balancer)


async def test_request_is_held_until_a_first_replica_is_ready(replicas: Replicas) -> None:
    f = await start_front(config=bal.Config(scales_from_zero=True))
    held = asyncio.Event()
    f.balancer.on_held = held.set
    try:

        async def get() -> tuple[int, str]:
            async with f.client.get(f.url + "/whoami") as resp:
                return resp.status, await resp.text()

        task = asyncio.create_task(get())
        await asyncio.wait_for(held.wait(), 10)
        assert f.balancer.held == 1
        assert f.balancer.unreported == 1  # the arrival is there for the report that goes now
        f.balancer.set_endpoints([await replicas.start(5)], version=1)  # the replica becomes READY
        assert await asyncio.wait_for(task, 10) == (200, "replica 5\n")
        assert f.balancer.held == 0
    finally:
        await f.client.close()
        await proxy.stop_http(f.runner, f.proxy)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary for a test certificate")
async def test_tls_termination(replicas: Replicas, tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    args = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    args += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    await asyncio.to_thread(
        subprocess.run,
        ["openssl", *args],
        check=True,
        capture_output=True,
        timeout=60,
    )
    f = await start_front(ssl_context=proxy.tls_context(str(cert), str(key)))
    try:
        f.balancer.set_endpoints([await replicas.start(1)], version=1)
        client_ctx = ssl.create_default_context(cafile=str(cert))
        async with f.client.get(f.url + "/echo", ssl=client_ctx) as resp:
            got = json.loads(await resp.read())
        assert got["headers"]["X-Forwarded-Proto"] == "https"
    finally:
        await f.client.close()
        await proxy.stop_http(f.runner, f.proxy)
