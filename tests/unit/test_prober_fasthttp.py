"""The prober's bare-connection GET (`fasthttp`): responses framed every way HTTP/1.x frames
them, connections kept alive and renewed, and everything unusual left to the general client,
whose outcome the probe then has."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import yarl

from services.prober import fasthttp, probing

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def read(*pieces: bytes) -> fasthttp._Response:
    """Feed a response in pieces; the parsed response."""
    response = fasthttp._Response()
    buffer = bytearray()
    for piece in pieces:
        buffer += piece
        response.feed(buffer)
    return response


@pytest.mark.parametrize(
    ("pieces", "status", "keep_alive"),
    [
        ([OK], 200, True),
        ([b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 5\r\n\r\nhel", b"lo"], 200, True),
        ([b"HTTP/1.1 503 No\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"], 503, False),
        ([b"HTTP/1.1 204 No Content\r\n\r\n"], 204, True),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n", b"5\r\npedia\r\n0\r\n\r\n"],
            200,
            True,
        ),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: 1\r\n\r\n"], 200, True),
        ([b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"], 200, False),
        ([b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"], 200, True),
    ],
)
def test_each_framing_is_read_to_its_end(pieces: list[bytes], status: int, keep_alive: bool) -> None:
    response = read(*pieces)
    assert (response.done, response.status, response.keep_alive) == (True, status, keep_alive)


def test_a_response_in_pieces_is_done_only_at_its_last_byte() -> None:
    assert not read(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel").done
    assert not read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwiki\r\n").done


def test_a_body_framed_by_the_connection_ends_with_it() -> None:
    response = read(b"HTTP/1.1 200 OK\r\n\r\nsome body")
    assert not response.done and not response.keep_alive
    response.closed()
    assert response.done and response.status == 200


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 302 Found\r\nLocation: /x\r\nContent-Length: 0\r\n\r\n",  # the general client follows it
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_anything_unusual_is_left_to_the_general_client(head: bytes) -> None:
    with pytest.raises(fasthttp.Unhandled):
        read(head)


class Replica:
    """A raw HTTP server whose answer to each request a test chooses."""

    def __init__(self, answer: Callable[[bytes], bytes | None]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        replica = self

        class Conn(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                assert isinstance(transport, asyncio.Transport)
                self.transport, self.buffer = transport, b""
                replica.connections += 1

            def data_received(self, data: bytes) -> None:
                self.buffer += data
                while b"\r\n\r\n" in self.buffer:
                    head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
                    replica.requests.append(head)
                    out = replica.answer(head)
                    if out is None:
                        self.transport.close()
                        return
                    self.transport.write(out)

        self.server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def prober() -> AsyncIterator[probing.HttpProber]:
    p = probing.HttpProber()
    yield p
    await p.close()


def target(url: str, path: str = "/health", **fields: object) -> probing.Target:
    return probing.make_target(probing.TargetSpec(target_id="t", url=url, path=path, **fields), probing.Defaults())  # type: ignore[arg-type]


async def test_probes_share_one_kept_alive_connection_and_send_the_targets_headers(
    prober: probing.HttpProber,
) -> None:
    replica = Replica(lambda _: OK)
    url = await replica.start()
    for _ in range(5):
        assert (await prober.probe(target(url, "/h?x=1", headers={"X-Token": "s3cret"}))).ready
    assert replica.connections == 1 and len(replica.requests) == 5
    lines = replica.requests[0].decode().split("\r\n")
    assert lines[0] == "GET /h?x=1 HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in lines and "X-Token: s3cret" in lines
    assert "User-Agent: replicaplane-prober" in lines


async def test_a_connection_the_replica_closed_is_replaced_without_a_failure(prober: probing.HttpProber) -> None:
    replica = Replica(lambda _: b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    url = await replica.start()
    for _ in range(3):
        assert (await prober.probe(target(url))).ready
    assert replica.connections == 3  # each answer closed its connection: a fresh one each time


async def test_a_replica_dropping_a_kept_alive_connection_is_retried_on_a_fresh_one(
    prober: probing.HttpProber,
) -> None:
    answers = iter([OK, None, OK])  # the second request finds its connection dropped
    replica = Replica(lambda _: next(answers))
    url = await replica.start()
    assert (await prober.probe(target(url))).ready
    assert (await prober.probe(target(url))).ready
    assert replica.connections == 2


async def test_a_redirect_is_followed_by_the_general_client(prober: probing.HttpProber) -> None:
    def answer(head: bytes) -> bytes:
        if head.startswith(b"GET /old "):
            return b"HTTP/1.1 302 Found\r\nLocation: /new\r\nContent-Length: 0\r\n\r\n"
        return OK

    replica = Replica(answer)
    url = await replica.start()
    result = await prober.probe(target(url, "/old"))
    assert result.ready and result.http_code == 200
    assert [h.split(b" ")[1] for h in replica.requests] == [b"/old", b"/old", b"/new"]


async def test_statuses_timeouts_and_refusals_are_failures_that_say_so(prober: probing.HttpProber) -> None:
    replica = Replica(lambda _: b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
    url = await replica.start()
    busy = await prober.probe(target(url))
    assert (busy.ready, busy.http_code, busy.error, busy.failure) == (
        False,
        503,
        "HTTP 503",
        probing.FailureKind.HTTP_STATUS,
    )

    silent = Replica(lambda _: b"")  # reads the request, never answers
    slow = await prober.probe(target(await silent.start(), timeout_s=0.2))
    assert (slow.failure, slow.error) == (probing.FailureKind.TIMEOUT, "timeout after 0.2s")
    assert slow.latency_s < 1.0  # not made again by the general client

    gone = Replica(lambda _: OK)
    url = await gone.start()
    assert gone.server is not None
    gone.server.close()
    await gone.server.wait_closed()
    refused = await prober.probe(target(url))
    assert (refused.failure, refused.error) == (probing.FailureKind.CONNECTION_REFUSED, "connection refused")


async def test_only_plain_http_gets_take_the_bare_path() -> None:
    assert fasthttp.Client.handles(yarl.URL("http://h:8/x"), "GET")
    assert not fasthttp.Client.handles(yarl.URL("https://h/x"), "GET")
    assert not fasthttp.Client.handles(yarl.URL("http://h/x"), "POST")
    assert not fasthttp.Client.handles(yarl.URL("http://user:pw@h/x"), "GET")
