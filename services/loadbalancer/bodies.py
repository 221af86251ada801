"""Request bodies: a small one is read whole so that a retry can send it again; any other streams
to the replica as it arrives, once.

The bytes held for retries count against one budget for the whole balancer, so concurrent uploads
cannot grow memory without bound: a body that does not fit the budget streams instead (it is then
retried only if no byte of it was sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import streams


class BodyError(Exception):
    """The client's body cannot be passed on: too large (413) or too slow (408)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Budget:
    """Bytes of request bodies held for retries, across every request of the balancer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        """Most bytes held at once since the start (for tests and the admin view)."""

    def take(self, n: int) -> bool:
        """Reserve n bytes; False (and nothing reserved) if they do not fit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        """Return n reserved bytes."""
        self.used -= n


class Body:
    """One request's body, read from the client under a size limit and an inactivity timeout.

    Call `prepare()` first (it reads a small body whole), `data()` once per attempt, and
    `release()` when the request ends.
    """

    def __init__(
        self,
        content: streams.StreamReader,
        *,
        length: int | None,
        present: bool,
        max_bytes: int,
        timeout_s: float,
        retry_bytes: int,
        budget: Budget,
    ) -> None:
        self._content = content
        self.length = length
        self._present = present
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._retry_bytes = retry_bytes
        self._budget = budget
        self._held = 0  # bytes reserved in the budget
        self._chunks: list[bytes] = []  # the start of a streamed body, read ahead
        self._whole = b""  # the entire body, when it was small enough to keep
        self.whole = not present
        """The entire body is in memory, so every attempt can send it."""
        self.received = 0
        self.started = False
        """An attempt began sending the streamed part: the body cannot be sent again."""
        self.error: BodyError | None = None
        """Why reading the client's body failed, if it did (the attempt fails with it)."""

    @property
    def replayable(self) -> bool:
        """Whether another attempt can send the body in full."""
        return self.whole or not self.started

    async def prepare(self) -> None:
        """Refuse an announced length over the limit; read a body small enough to keep for retries.

        Raises:
            BodyError: too large, or the client stopped sending.
        """
        if not self._present:
            return
        if self.length is not None and self.length > self._max_bytes:
            raise BodyError(413, f"request body of {self.length} bytes is over the limit of {self._max_bytes}")
        if self.length is not None:
            if self.length > self._retry_bytes or not self._reserve(self.length):
                return  # streamed
            while chunk := await self._read():
                self._chunks.append(chunk)
            self._keep_whole()
            return
        # No length (chunked): read ahead while the body still fits the retry buffer and the budget.
        while True:
            chunk = await self._read()
            if not chunk:
                self._keep_whole()
                return
            self._chunks.append(chunk)
            if self.received > self._retry_bytes or not self._reserve(len(chunk)):
                return  # streamed, starting with what was read

    def data(self) -> bytes | AsyncIterator[bytes] | None:
        """What one attempt sends: the bytes, a stream, or None for no body."""
        if self.whole:
            return self._whole or None
        return self._stream()

    def release(self) -> None:
        """The request ended: return the reserved bytes and drop the kept body."""
        self._budget.give(self._held)
        self._held = 0
        self._chunks = []
        self._whole = b""

    def _keep_whole(self) -> None:
        self._whole = b"".join(self._chunks)
        self._chunks = []
        self.whole = True

    def _reserve(self, n: int) -> bool:
        if not self._budget.take(n):
            return False
        self._held += n
        return True

    async def _read(self) -> bytes:
        try:
            async with asyncio.timeout(self._timeout_s):
                chunk = await self._content.readany()
        except TimeoutError:
            raise BodyError(408, f"request body stalled: no data for {self._timeout_s:g} s") from None
        self.received += len(chunk)
        if self.received > self._max_bytes:
            raise BodyError(413, f"request body is over the limit of {self._max_bytes} bytes")
        return chunk

    async def _stream(self) -> AsyncIterator[bytes]:
        self.started = True
        try:
            chunks, self._chunks = self._chunks, []
            self.release()  # the read-ahead goes out now; it is not kept for a retry
            for chunk in chunks:
                yield chunk
            while chunk := await self._read():
                yield chunk
        except BodyError as exc:
            # aiohttp reports a failing body as a connection error of the attempt; keep the cause.
            self.error = exc
            raise
