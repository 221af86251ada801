"""The balancer's HTTP edges against real sockets: which attempts are retried, hop-by-hop headers,
request targets, streamed bodies and their memory bound, slow or idle clients and the connection
cap. Replicas are tiny real servers on 127.0.0.1 port 0 (raw HTTP where the test needs exact bytes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import ssl
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.loadbalancer import balancer as bal
from services.loadbalancer import policies, proxy
from tests.helpers import certs

MiB = 1024 * 1024


class RawReplica:
    """A replica speaking raw HTTP/1.1: it records every request it read in full (head and body),
    then answers `reply` and closes, or closes without a word when `reply` is None."""

    def __init__(self, rid: int, reply: bytes | None) -> None:
        self.rid = rid
        self.reply = reply
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> policies.Replica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return policies.Replica(replica_id=self.rid, url=f"http://127.0.0.1:{port}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length)
            self.requests.append((head, body))
            if self.reply is not None:
                # A HEAD answer has no body.
                writer.write(self.reply.split(b"\r\n\r\n")[0] + b"\r\n\r\n" if head.startswith(b"HEAD") else self.reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def heads(self) -> list[dict[str, str]]:
        """Each request's target and headers (names lowercased; `:target` is the request target)."""
        out = []
        for head, _ in self.requests:
            lines = head.decode("latin-1").split("\r\n")
            fields = {":target": lines[0].split(" ")[1]}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
            out.append(fields)
        return out

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"


class Sink:
    """An aiohttp replica whose /sink reads the body as it arrives and answers its size and sha256,
    and whose /drip reads the body, then answers in three parts 0.2 s apart."""

    def __init__(self, rid: int, *, pause_s: float = 0.0) -> None:
        self.rid = rid
        self.pause_s = pause_s
        self.runner: web.AppRunner | None = None

    async def _sink(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.pause_s)
        digest, size = hashlib.sha256(), 0
        while chunk := await request.content.readany():
            digest.update(chunk)
            size += len(chunk)
        return web.json_response({"replica": self.rid, "bytes": size, "sha256": digest.hexdigest()})

    async def _drip(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"part{i}\n".encode())
            await asyncio.sleep(0.2)
        await resp.write_eof()
        return resp

    async def start(self) -> policies.Replica:
        app = web.Application()
        app.router.add_route("*", "/sink", self._sink)
        app.router.add_route("*", "/drip", self._drip)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return policies.Replica(replica_id=self.rid, url=f"http://127.0.0.1:{self.runner.addresses[0][1]}")

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class Front:
    """A balancer and its proxy on 127.0.0.1 port 0."""

    def __init__(self, b: bal.Balancer, px: proxy.Proxy, runner: web.BaseRunner, port: int, scheme: str) -> None:
        self.balancer = b
        self.proxy = px
        self.runner = runner
        self.port = port
        self.url = f"{scheme}://127.0.0.1:{port}"


@pytest.fixture
async def start_front(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator:
    # A refused body is read and dropped for 0.3 s, not 2 s, before the close: the answer still
    # comes first, and the tests that read until the close wait less.
    monkeypatch.setattr(proxy, "_LINGER_S", 0.3, raising=False)
    fronts: list[Front] = []

    async def start(*, ssl_context: ssl.SSLContext | None = None, **settings: object) -> Front:
        b = bal.Balancer("web", hold_timeout_s=0.0, hold_max=5)
        b.configure(bal.Config())
        px = proxy.Proxy(b, proxy.ProxySettings(backoff_initial_s=0.01, **settings))  # type: ignore[arg-type]
        runner, port = await proxy.start_http(px, "127.0.0.1", 0, ssl_context=ssl_context, shutdown_timeout_s=0.5)
        fronts.append(Front(b, px, runner, port, "https" if ssl_context else "http"))
        return fronts[-1]

    yield start
    for f in fronts:
        await proxy.stop_http(f.runner, f.proxy)


@pytest.fixture
async def servers() -> AsyncIterator[list]:
    started: list = []
    yield started
    for s in started:
        await s.close()


async def start_replicas(servers: list, *replicas: RawReplica | Sink) -> list[policies.Replica]:
    servers.extend(replicas)
    return [await r.start() for r in replicas]


async def exchange(port: int, data: bytes, *, wait_s: float = 10.0) -> bytes:
    """Send raw bytes to the balancer and read until it closes the connection (at most wait_s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait_s)
    finally:
        writer.close()


def request(line: str, *headers: str, body: bytes = b"") -> bytes:
    """One raw request that asks the balancer to close the connection after answering."""
    return "\r\n".join([line, "Host: x", *headers, "Connection: close", "", ""]).encode() + body


def final(raw: bytes) -> bytes:
    """The response without interim (1xx) ones before it."""
    while raw.startswith(b"HTTP/1.1 1"):
        raw = raw.split(b"\r\n\r\n", 1)[1]
    return raw


def status_of(raw: bytes) -> int:
    return int(final(raw).split(b" ", 2)[1])


def headers_of(raw: bytes) -> dict[str, str]:
    head = final(raw).split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


def body_of(raw: bytes) -> bytes:
    return final(raw).split(b"\r\n\r\n", 1)[1]


async def closed_within(reader: asyncio.StreamReader, wait_s: float) -> bytes | None:
    """What the balancer sent before closing the connection, or None if still open after wait_s."""
    got = b""
    try:
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return got


async def drained(b: bal.Balancer) -> None:
    for _ in range(200):
        if not b.in_flight.counts:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"in-flight counts did not return to 0: {b.in_flight.counts}")


# ---- which attempts are retried -------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_request_that_reached_a_replica_is_not_replayed_unless_idempotent(
    start_front, servers, method: str
) -> None:
    front = await start_front()
    front.balancer.set_endpoints(await start_replicas(servers, RawReplica(1, None), RawReplica(2, None)), version=1)
    raw = await exchange(front.port, request(f"{method} /charge HTTP/1.1", "Content-Length: 3", body=b"$10"))
    assert status_of(raw) == 502
    assert b"may have processed it" in body_of(raw)
    got = [req for s in servers for req in s.requests]
    assert len(got) == 1  # the charge ran once
    assert got[0][1] == b"$10"
    await drained(front.balancer)


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"])
async def test_idempotent_request_is_retried_when_its_replica_closed_after_reading_it(
    start_front, servers, method: str
) -> None:
    front = await start_front()
    closing = RawReplica(1, None)
    first = await start_replicas(servers, closing)
    front.balancer.set_endpoints(first, version=1)
    raw = await exchange(front.port, request(f"{method} /item HTTP/1.1", "Content-Length: 0"))
    assert status_of(raw) == 502
    assert len(closing.requests) == 3  # every attempt
    # With a healthy replica too, the client never sees the failure.
    good = RawReplica(2, OK)
    front.balancer.set_endpoints([*first, *(await start_replicas(servers, good))], version=2)
    for _ in range(4):
        raw = await exchange(front.port, request(f"{method} /item HTTP/1.1"))
        assert status_of(raw) == 200
    await drained(front.balancer)


async def test_failed_attempts_are_logged_without_the_query(start_front, servers, caplog) -> None:
    front = await start_front()
    front.balancer.set_endpoints(await start_replicas(servers, RawReplica(1, None)), version=1)
    caplog.set_level("INFO", logger="services.loadbalancer.proxy")
    raw = await exchange(front.port, request("GET /x?token=s3cret HTTP/1.1"))
    assert status_of(raw) == 502
    assert "attempt 1 of GET /x failed" in caplog.text
    assert "s3cret" not in caplog.text


async def test_post_is_retried_when_the_connection_was_refused(start_front, servers) -> None:
    front = await start_front()
    gone = RawReplica(1, OK)
    dead = (await start_replicas(servers, gone))[0]
    await gone.close()
    live = RawReplica(2, OK)
    front.balancer.set_endpoints([dead, *(await start_replicas(servers, live))], version=1)
    for i in range(4):
        raw = await exchange(front.port, request("POST /pay HTTP/1.1", "Content-Length: 1", body=str(i).encode()))
        assert status_of(raw) == 200
    assert [body for _, body in live.requests] == [b"0", b"1", b"2", b"3"]
    assert front.balancer.in_flight.totals.get(1, 0) >= 1  # the refused replica was tried


async def test_post_is_retried_when_connecting_timed_out(start_front, servers) -> None:
    # A listener whose accept queue is full drops new SYNs: connecting to it hangs.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(blackhole.getsockname())
        except BlockingIOError:
            pass
        fillers.append(s)
    try:
        front = await start_front(connect_timeout_s=0.3)
        live = RawReplica(2, OK)
        silent = policies.Replica(replica_id=1, url=f"http://127.0.0.1:{blackhole.getsockname()[1]}")
        front.balancer.set_endpoints([silent, *(await start_replicas(servers, live))], version=1)
        for i in range(3):
            raw = await exchange(front.port, request("POST /pay HTTP/1.1", "Content-Length: 1", body=str(i).encode()))
            assert status_of(raw) == 200, raw
        assert [body for _, body in live.requests] == [b"0", b"1", b"2"]
        assert front.balancer.in_flight.totals.get(1, 0) >= 1
    finally:
        for s in [*fillers, blackhole]:
            s.close()


# ---- hop-by-hop headers -----------------------------------------------------------------------


async def test_connection_named_and_hop_by_hop_headers_are_stripped_both_ways(start_front, servers) -> None:
    front = await start_front()
    reply = (
        b"HTTP/1.1 200 OK\r\nConnection: close, X-Hop-Resp\r\nconnection: x-other-resp\r\nX-Hop-Resp: 1\r\n"
        b"X-Other-Resp: 2\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nX-End: kept\r\n"
        b"Content-Length: 3\r\n\r\nok\n"
    )
    replica = RawReplica(1, reply)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    raw = await exchange(
        front.port,
        b"GET /h HTTP/1.1\r\nHost: x\r\nConnection: close, X-Hop-Req\r\nconnection: x-other-req\r\n"
        b"X-Hop-Req: 1\r\nX-Other-Req: 2\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n"
        b"Proxy-Authorization: Basic eDp5\r\nTE: trailers\r\nExpect: 100-continue\r\nX-End: kept\r\n\r\n",
    )
    assert status_of(raw) == 200
    sent = replica.heads()[0]
    for name in ("x-hop-req", "x-other-req", "keep-alive", "proxy-connection", "proxy-authorization", "te", "expect"):
        assert name not in sent, name
    assert sent["x-end"] == "kept"
    got = headers_of(raw)
    for name in ("x-hop-resp", "x-other-resp", "keep-alive", "proxy-connection"):
        assert name not in got, name
    assert got["x-end"] == "kept"
    assert body_of(raw) == b"ok\n"


async def test_expect_100_continue_is_answered_by_the_balancer(start_front, servers) -> None:
    front = await start_front()
    replica = RawReplica(1, OK)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(request("PUT /doc HTTP/1.1", "Content-Length: 4", "Expect: 100-continue"))
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # before any body byte
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"data")
        assert status_of(await asyncio.wait_for(reader.read(), 5)) == 200
    finally:
        writer.close()
    assert replica.requests[0][1] == b"data"
    assert "expect" not in replica.heads()[0]
    raw = await exchange(front.port, request("PUT /doc HTTP/1.1", "Content-Length: 4", "Expect: something-else"))
    assert status_of(raw) == 417


# ---- request targets --------------------------------------------------------------------------


async def test_absolute_form_target_is_proxied_as_its_path(start_front, servers) -> None:
    front = await start_front()
    replica = RawReplica(1, OK)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    for target, path in [
        ("http://other.example/abs?q=1&r=%2F", "/abs?q=1&r=%2F"),
        ("HTTP://Other.Example:8080", "/"),
        ("https://other.example//two//slashes", "//two//slashes"),
    ]:
        raw = await exchange(front.port, request(f"GET {target} HTTP/1.1"))
        assert status_of(raw) == 200, raw
        sent = replica.heads()[-1]
        assert sent[":target"] == path
    assert replica.heads()[0]["x-forwarded-host"] == "other.example"  # the target's authority wins over Host


async def test_leading_double_slash_is_kept_byte_for_byte(start_front, servers) -> None:
    front = await start_front()
    replica = RawReplica(1, OK)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    targets = ["//x", "//a:1/b?c=%2F", "///x//y/", "/%2F%2Fx?u=//v"]
    for target in targets:
        raw = await exchange(front.port, request(f"GET {target} HTTP/1.1"))
        assert status_of(raw) == 200
    assert [h[":target"] for h in replica.heads()] == targets


async def test_targets_that_are_not_paths_get_400(start_front, servers) -> None:
    front = await start_front()
    replica = RawReplica(1, OK)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    for line in ["OPTIONS * HTTP/1.1", "CONNECT other.example:443 HTTP/1.1", "GET ftp://other.example/f HTTP/1.1"]:
        raw = await exchange(front.port, request(line))
        assert status_of(raw) == 400, raw
        assert b"request target" in body_of(raw)
        assert b"Traceback" not in raw
    assert replica.requests == []


# ---- bodies -----------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_large_post_streams_through_with_bounded_memory(start_front, servers) -> None:
    front = await start_front()
    sink = Sink(1)
    front.balancer.set_endpoints(await start_replicas(servers, sink), version=1)
    chunk = os.urandom(MiB)
    total = 60 * MiB

    async def body() -> AsyncIterator[bytes]:
        for _ in range(total // MiB):
            yield chunk

    peak = base = rss_bytes()
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.post(front.url + "/sink", data=body(), headers={"Content-Length": str(total)}) as resp,
        ):
            assert resp.status == 200
            got = await resp.json()
    finally:
        stop.set()
        await sampler
    digest = hashlib.sha256()
    for _ in range(total // MiB):
        digest.update(chunk)
    assert got == {"replica": 1, "bytes": total, "sha256": digest.hexdigest()}
    # Read whole, the body alone would add 60 MiB; streamed, only a few chunks are in memory.
    assert peak - base < 24 * MiB, f"RSS grew {(peak - base) / MiB:.0f} MiB"
    assert front.proxy.buffered.peak == 0  # too large to buffer for a retry
    await drained(front.balancer)


async def test_buffered_bodies_stay_within_the_total_bound(start_front, servers) -> None:
    front = await start_front(retry_buffer_bytes=256 * 1024, max_buffered_bytes=512 * 1024)
    sink = Sink(1, pause_s=0.3)  # keeps every request open, so the buffers are held at once
    front.balancer.set_endpoints(await start_replicas(servers, sink), version=1)
    payloads = [bytes([i]) * (200 * 1024) for i in range(6)]

    async def post(client: aiohttp.ClientSession, data: bytes) -> dict:
        async with client.post(front.url + "/sink", data=data) as resp:
            assert resp.status == 200
            return json.loads(await resp.read())

    async with aiohttp.ClientSession() as client:
        answers = await asyncio.gather(*(post(client, p) for p in payloads))
    assert [a["sha256"] for a in answers] == [hashlib.sha256(p).hexdigest() for p in payloads]
    assert 0 < front.proxy.buffered.peak <= 512 * 1024
    assert front.proxy.buffered.used == 0


async def test_a_kept_body_is_let_go_once_the_answer_starts(start_front, servers) -> None:
    front = await start_front()
    front.balancer.set_endpoints(await start_replicas(servers, Sink(1)), version=1)
    async with (
        aiohttp.ClientSession() as client,
        client.post(front.url + "/drip", data=b"b" * 100_000) as resp,
    ):
        assert await resp.content.readline() == b"part0\n"
        assert front.proxy.buffered.peak >= 100_000
        assert front.proxy.buffered.used == 0  # no retry can happen now: a long answer holds no buffer
        assert await resp.read() == b"part1\npart2\n"


async def test_streamed_post_is_retried_when_no_replica_was_reached(start_front, servers) -> None:
    front = await start_front(retry_buffer_bytes=64 * 1024)
    gone = RawReplica(1, OK)
    dead = (await start_replicas(servers, gone))[0]
    await gone.close()
    front.balancer.set_endpoints([dead, *(await start_replicas(servers, Sink(2)))], version=1)
    data = os.urandom(3 * MiB)

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(data), MiB):
            yield data[i : i + MiB]

    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            async with client.post(front.url + "/sink", data=body()) as resp:  # chunked, no length
                assert resp.status == 200
                assert (await resp.json())["sha256"] == hashlib.sha256(data).hexdigest()
    assert front.balancer.in_flight.totals.get(1, 0) >= 1


async def test_body_over_the_limit_is_413(start_front, servers) -> None:
    front = await start_front(max_body_bytes=MiB, retry_buffer_bytes=64 * 1024)
    front.balancer.set_endpoints(await start_replicas(servers, Sink(1)), version=1)
    raw = await exchange(front.port, request("POST /sink HTTP/1.1", f"Content-Length: {2 * MiB}"))
    assert status_of(raw) == 413

    async def body() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"z" * (MiB // 2)

    async with aiohttp.ClientSession() as client:
        try:
            async with client.post(front.url + "/sink", data=body()) as resp:
                assert resp.status == 413
        except aiohttp.ClientOSError:
            pass  # the balancer may close before the client finished sending: also a refusal
    await drained(front.balancer)


# ---- slow and idle clients, connection cap ----------------------------------------------------


async def test_partial_headers_are_cut_after_the_header_timeout(start_front) -> None:
    front = await start_front(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            for _ in range(100):  # one header byte every 0.05 s: never a complete head
                writer.write(b"X")
                await asyncio.sleep(0.05)

        dribbler = asyncio.create_task(trickle())
        got = await closed_within(reader, 4.0)
        dribbler.cancel()
        await asyncio.gather(dribbler, return_exceptions=True)
        assert got is not None, "still open 4 s after a 0.5 s header timeout"
        assert got == b"" or status_of(got) == 408
    finally:
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed(start_front) -> None:
    front = await start_front(header_timeout_s=0.5, idle_timeout_s=60.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        assert await closed_within(reader, 4.0) is not None
    finally:
        writer.close()


async def test_partial_body_is_cut_after_the_body_timeout(start_front, servers) -> None:
    front = await start_front(body_timeout_s=0.5)
    replica = RawReplica(1, OK)
    front.balancer.set_endpoints(await start_replicas(servers, replica), version=1)
    for length in (100, 10 * MiB):  # buffered for retry, and streamed
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        try:
            writer.write(f"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode() + b"0" * 10)
            got = await closed_within(reader, 8.0)
            assert got is not None, f"still open 8 s after a 0.5 s body timeout (Content-Length {length})"
            assert status_of(got) == 408
        finally:
            writer.close()
    assert replica.requests == []  # nothing complete reached the replica
    await drained(front.balancer)


async def test_idle_keep_alive_connection_is_closed_after_the_idle_timeout(start_front, servers) -> None:
    front = await start_front(idle_timeout_s=0.5, header_timeout_s=30.0)
    front.balancer.set_endpoints(await start_replicas(servers, RawReplica(1, OK)), version=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert status_of(head) == 200
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"ok\n"
        assert await closed_within(reader, 4.0) == b""
    finally:
        writer.close()


async def test_many_slowloris_connections_are_all_closed(start_front) -> None:
    front = await start_front(header_timeout_s=0.5)
    conns = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(200)]
    try:
        for i, (_, writer) in enumerate(conns):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")  # half send a partial head
        closed = await asyncio.gather(*(closed_within(reader, 8.0) for reader, _ in conns))
        assert sum(c is not None for c in closed) == 200
    finally:
        for _, writer in conns:
            writer.close()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_slow_answer_is_not_cut_by_the_client_timeouts(start_front, servers, tmp_path, tls: bool) -> None:
    server_ctx = client_ctx = None
    if tls:
        identity = certs.Authority(str(tmp_path)).issue("127.0.0.1")
        server_ctx = proxy.tls_context(identity.cert_file, identity.key_file)
        client_ctx = ssl.create_default_context(cafile=identity.ca_file)
    front = await start_front(ssl_context=server_ctx, header_timeout_s=0.3, idle_timeout_s=0.3, body_timeout_s=0.3)
    front.balancer.set_endpoints(await start_replicas(servers, Sink(1, pause_s=1.0)), version=1)
    async with aiohttp.ClientSession() as client:
        for _ in range(2):  # the second request comes on the same connection
            async with client.post(front.url + "/sink", data=b"x" * 10, ssl=client_ctx) as resp:
                assert resp.status == 200
                assert (await resp.json())["bytes"] == 10


async def test_connections_over_the_cap_get_503(start_front, servers) -> None:
    front = await start_front(max_connections=3, header_timeout_s=30.0)
    front.balancer.set_endpoints(await start_replicas(servers, RawReplica(1, OK)), version=1)
    held = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(3)]
    try:
        raw = await exchange(front.port, request("GET /a HTTP/1.1"), wait_s=5)
        assert status_of(raw) == 503
        assert headers_of(raw)["retry-after"] == "1"
        assert b"too many connections" in body_of(raw)
        held.pop()[1].close()
        for _ in range(100):  # the balancer notices the close on its next loop turn
            raw = await exchange(front.port, request("GET /a HTTP/1.1"), wait_s=5)
            if status_of(raw) == 200:
                break
            await asyncio.sleep(0.02)
        assert status_of(raw) == 200
    finally:
        for _, writer in held:
            writer.close()
