"""The common probe (a GET over plain http) made on bare asyncio connections, kept alive per host
and port: about a third of the cost of a general HTTP client per probe, which at 10,000
replicas was most of a prober's CPU. Anything out of the ordinary (a redirect, an interim
response, a malformed or unframed answer, a connection that fails other than by refusal) raises
`Unhandled`, and the caller makes the probe again with its general client, so outcomes and
failure reasons stay that client's."""

from __future__ import annotations

import asyncio
import time

import yarl

# Statuses the general client follows (redirects) or reads past (interim responses).
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_HEAD = 64 * 1024  # a response head longer than this is not a probe answer
_MAX_IDLE_PER_HOST = 256  # many replicas can share one host and port (a node, a test server)


class Unhandled(Exception):
    """Not a probe this client makes to the end: make it with the general client."""


class _Response:
    """Reads one HTTP/1.1 response from bytes as they come; only its status is kept."""

    def __init__(self) -> None:
        self.status = 0
        self.keep_alive = False
        self._head_done = False
        self._remaining = 0  # body bytes still to come (content-length)
        self._chunked = False
        self._until_close = False
        self.done = False

    def feed(self, buffer: bytearray) -> None:
        """Consume what `buffer` holds of the response (it is emptied of what was read).

        Raises:
            Unhandled: not a response this client reads.
        """
        if not self._head_done:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise Unhandled("response head too long")
                return
            self._head(bytes(buffer[:end]))
            del buffer[: end + 4]
        if self._until_close:
            buffer.clear()
            return
        if self._chunked:
            self._chunks(buffer)
            return
        taken = min(self._remaining, len(buffer))
        del buffer[:taken]
        self._remaining -= taken
        self.done = self._remaining == 0

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].isdigit():
            raise Unhandled("not an HTTP/1.x status line")
        self.status = int(parts[1])
        if self.status < 200 or self.status in _REDIRECTS:
            raise Unhandled(f"status {self.status}")
        length: int | None = None
        close = parts[0] == b"HTTP/1.0"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise Unhandled("malformed header")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise Unhandled("bad content-length")
                length = int(value)
            elif name == b"transfer-encoding":
                if value != b"chunked":
                    raise Unhandled("transfer-encoding")
                self._chunked = True
            elif name == b"connection":
                close = b"close" in value if parts[0] == b"HTTP/1.1" else b"keep-alive" not in value
        self._head_done = True
        self.keep_alive = not close
        if self.status in (204, 304):
            self._chunked, length = False, 0
        if self._chunked:
            return
        if length is None:
            self._until_close, self.keep_alive = True, False  # the body ends with the connection
            return
        self._remaining = length
        self.done = length == 0

    def _chunks(self, buffer: bytearray) -> None:
        while True:
            if self._remaining > 0:
                taken = min(self._remaining, len(buffer))
                del buffer[:taken]
                self._remaining -= taken
                if self._remaining:
                    return
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise Unhandled("chunk line too long")
                return
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if self._remaining < 0:  # after the last chunk: trailers, then an empty line
                if not line:
                    self.done = True
                    return
                continue
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise Unhandled("bad chunk size") from None
            if size == 0:
                self._remaining = -1
                continue
            self._remaining = size + 2  # the chunk and its CRLF

    def closed(self) -> None:
        """The connection ended."""
        if self._until_close and self._head_done:
            self.done = True


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buffer = bytearray()
        self._response: _Response | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._response is None:
            self.closed = True  # bytes nobody asked for: this connection is not reused
            return
        try:
            self._response.feed(self._buffer)
        except Unhandled as exc:
            self._wake(exc)
            return
        if self._response.done:
            self._wake(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None:
            self._response.closed()
            self._wake(None if self._response.done else ConnectionResetError("closed before the response"))

    def _wake(self, exc: BaseException | None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    async def request(self, data: bytes) -> _Response:
        """Send one request and read its response.

        Raises:
            Unhandled: a response this client does not read.
            ConnectionError: the connection ended first.
        """
        assert self.transport is not None
        response = self._response = _Response()
        self._buffer.clear()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            await self._waiter
        finally:
            self._response = self._waiter = None
        if self._buffer:
            self.closed = True  # more bytes than the response: never reuse
        return response

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Client:
    """GETs over plain http on connections kept alive per host and port.

    Args:
        keepalive_s: how long an idle connection is kept for reuse.
        user_agent: the User-Agent header.
    """

    def __init__(self, *, keepalive_s: float, user_agent: str) -> None:
        self._keepalive_s = keepalive_s
        self._user_agent = user_agent
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._swept = time.monotonic()

    @staticmethod
    def handles(url: yarl.URL, method: str) -> bool:
        """Whether a probe of `url` with `method` is one this client makes."""
        return method == "GET" and url.scheme == "http" and not url.user and bool(url.host)

    async def get(self, url: yarl.URL, headers: tuple[tuple[str, str], ...]) -> int:
        """GET `url`; its HTTP status. The caller bounds the time.

        Raises:
            Unhandled: make the probe with the general client.
            ConnectionRefusedError: nothing listens there.
        """
        host, port = url.host or "", url.port or 80
        data = self._request_bytes(url, headers)
        key = (host, port)
        while (conn := self._take(key)) is not None:
            try:
                response = await conn.request(data)
            except ConnectionError:
                conn.close()
                continue  # the replica closed this kept-alive connection meanwhile: a fresh one
            except BaseException:
                conn.close()
                raise
            self._give_back(key, conn, response.keep_alive)
            return response.status
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Connection, host, port)
        except ConnectionRefusedError:
            raise
        except OSError as exc:
            raise Unhandled(f"connect: {exc.__class__.__name__}") from None
        try:
            response = await conn.request(data)
        except ConnectionError:
            conn.close()
            raise Unhandled("disconnected") from None
        except BaseException:
            conn.close()
            raise
        self._give_back(key, conn, response.keep_alive)
        return response.status

    def _request_bytes(self, url: yarl.URL, headers: tuple[tuple[str, str], ...]) -> bytes:
        host = url.raw_host or ""
        if ":" in host:
            host = f"[{host}]"
        if url.explicit_port is not None and url.explicit_port != 80:
            host = f"{host}:{url.explicit_port}"
        names = {name.lower() for name, _ in headers}
        lines = [f"GET {url.raw_path_qs} HTTP/1.1"]
        if "host" not in names:
            lines.append(f"Host: {host}")
        if "user-agent" not in names:
            lines.append(f"User-Agent: {self._user_agent}")
        if "accept" not in names:
            lines.append("Accept: */*")
        lines += [f"{name}: {value}" for name, value in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    def _give_back(self, key: tuple[str, int], conn: _Connection, keep_alive: bool) -> None:
        now = time.monotonic()
        idle = self._idle.setdefault(key, [])
        if not keep_alive or conn.closed or len(idle) >= _MAX_IDLE_PER_HOST:
            conn.close()
        else:
            conn.idle_since = now
            idle.append(conn)
        if now - self._swept > self._keepalive_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        self._swept = now
        for key in list(self._idle):
            kept = [c for c in self._idle[key] if not c.closed and now - c.idle_since < self._keepalive_s]
            for conn in self._idle[key]:
                if conn not in kept:
                    conn.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
