"""A test client of one Probe stream: send target changes, collect and wait for results."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable

import grpc
from google.protobuf import duration_pb2

from replicaplane.prober.v1 import prober_service_pb2 as pb
from replicaplane.prober.v1 import prober_service_pb2_grpc

Predicate = Callable[[pb.ProbeResult], bool]


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds`."""
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def target(target_id: str, url: str, path: str = "/", **kwargs: object) -> pb.ProbeTarget:
    """A ProbeTarget; durations may be given as float seconds (timeout=0.2)."""
    for name in ("timeout", "interval", "fast_interval"):
        if isinstance(kwargs.get(name), int | float):
            kwargs[name] = duration(float(kwargs[name]))  # type: ignore[arg-type]
    return pb.ProbeTarget(target_id=target_id, url=url, path=path, **kwargs)  # type: ignore[arg-type]


class ProbeSession:
    """One open Probe stream to a prober, with every result it received (and when).

    Args:
        addr: host:port of the prober.
    """

    def __init__(self, addr: str) -> None:
        self._channel = grpc.aio.insecure_channel(addr)
        self._call = prober_service_pb2_grpc.ProberServiceStub(self._channel).Probe()
        self.results: list[tuple[float, pb.ProbeResult]] = []
        self.responses: list[pb.ProbeResponse] = []
        self.initial_metadata: dict[str, str] = {}
        self.ended: grpc.StatusCode | None = None
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ProbeSession:
        self.initial_metadata = {k: str(v) for k, v in (await self._call.initial_metadata() or ())}
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the stream and close the channel."""
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._channel.close()

    async def _read(self) -> None:
        try:
            async for response in self._call:
                now = time.perf_counter()
                self.responses.append(response)
                self.results += [(now, r) for r in response.results]
                self._changed.set()
            self.ended = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            self.ended = exc.code()
        self._changed.set()

    async def send(self, upsert: Iterable[pb.ProbeTarget] = (), remove: Iterable[str] = ()) -> None:
        """Send one ProbeRequest."""
        await self._call.write(pb.ProbeRequest(upsert_targets=list(upsert), remove_target_ids=list(remove)))

    def matching(self, predicate: Predicate, since: float = 0.0) -> list[pb.ProbeResult]:
        """Results received at or after perf_counter time `since` that match."""
        return [r for t, r in self.results if t >= since and predicate(r)]

    async def wait_for(self, predicate: Predicate, *, since: float = 0.0, timeout: float = 5.0) -> pb.ProbeResult:
        """Wait for a result matching `predicate` received at or after `since`.

        Raises:
            TimeoutError: none came within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.matching(predicate, since)
            if found:
                return found[0]
            left = deadline - time.monotonic()
            if left <= 0 or self.ended is not None:
                raise TimeoutError("no matching probe result")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def wait_for_end(self, timeout: float = 5.0) -> grpc.StatusCode | None:
        """Wait until the prober ends the stream; return its status code."""
        deadline = time.monotonic() + timeout
        while self.ended is None and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
        return self.ended
