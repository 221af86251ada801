"""Client of the prober fleet: spreads probe targets over every prober and survives their loss.

The fleet is a set of prober addresses (a fixed list, or every address a DNS name resolves to,
re-resolved so that probers added later get work). Each prober gets several Probe streams; each
target lives on exactly one live stream, chosen least-loaded (probe_placement.py keeps that
bookkeeping; this module runs the streams). When a stream breaks, its targets move to the live
streams at once and the stream reconnects with backoff. When no stream is live, targets get
PROBE_UNAVAILABLE results (never a replica failure) and the fleet is stale.

We balance ourselves rather than through gRPC's round_robin policy: round_robin picks among
the subchannels that happen to be READY when a stream opens, so streams opened during startup
bunch onto the first prober, and an open stream never moves; one channel per prober tells us
exactly which prober each stream is on, so the spread is even and a lost prober is noticed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import socket
import time
from collections.abc import Callable

import grpc

from replicaplane.prober.v1 import prober_service_pb2 as pb
from replicaplane.prober.v1 import prober_service_pb2_grpc
from services.common import clients, probe_placement, waits

log = logging.getLogger(__name__)

PROBER_ID_METADATA = "x-prober-id"
"""Initial-metadata key a prober sends as soon as it accepts a stream: the stream is live."""

ResultsCallback = Callable[[list[pb.ProbeResult]], None]
StaleCallback = Callable[[bool], None]


def parse_targets(targets: str) -> tuple[str, list[str]]:
    """Split a fleet address.

    Args:
        targets: "host:port,host:port" (an optional "ipv4:" prefix is accepted), or
            "dns:///name:port" meaning every address the name resolves to.

    Returns:
        ("dns", ["name:port"]) or ("list", [addresses]).

    Raises:
        ValueError: the string names no address.
    """
    text = targets.strip()
    if text.startswith("dns:"):
        rest = text[len("dns:") :].lstrip("/")
        if not rest:
            raise ValueError("dns target without a name")
        return "dns", [rest]
    if text.startswith("ipv4:"):
        text = text[len("ipv4:") :]
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("no prober address")
    return "list", addresses


def _split_host_port(name: str) -> tuple[str, int]:
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected name:port, got {name!r}")
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(eq=False)
class _Prober:
    """A prober address, its channel and its streams."""

    addr: str
    channel: grpc.aio.Channel
    streams: list[probe_placement.Stream]


DEFAULT_LIVENESS_TIMEOUT_S = 5.0
"""A stream with no message (results or heartbeat) for this long counts as broken."""
HEARTBEAT_INTERVAL_S = 1.0
"""How often a prober sends an empty message on a quiet stream (its default setting)."""


class ProbeFleet:
    """Spreads probe targets over a fleet of probers and delivers their results.

    Args:
        targets: "host:port,host:port", or "dns:///name:port" (every address the name resolves
            to, re-resolved every `resolve_interval_s`).
        on_results: called on the event loop with each batch of results. Results for targets
            that could not be probed because no prober was reachable have outcome
            PROBE_OUTCOME_PROBE_UNAVAILABLE: no information, never a replica failure.
        on_stale: called with the new value whenever `stale` changes, and once at the end of
            start().
        streams_per_prober: Probe streams opened to each prober.
        connect_timeout_s: how long a stream may take to be accepted.
        backoff_min_s: first reconnect delay of a broken stream.
        backoff_max_s: longest reconnect delay.
        resolve_interval_s: how often a DNS name is resolved again.
        start_wait_s: how long start() waits for a first live stream.
        max_request_targets: targets per ProbeRequest message at most.
        liveness_timeout_s: a live stream with no message for this long is broken: probers
            send a heartbeat every HEARTBEAT_INTERVAL_S, so a prober that is frozen or cut
            off without a connection reset is noticed within this time, not keepalive's 40 s.
        make_channel: opens the channel to one prober (TLS credentials go here).
    """

    def __init__(
        self,
        targets: str,
        *,
        on_results: ResultsCallback,
        on_stale: StaleCallback | None = None,
        streams_per_prober: int = 4,
        connect_timeout_s: float = 2.0,
        backoff_min_s: float = 0.1,
        backoff_max_s: float = 2.0,
        resolve_interval_s: float = 5.0,
        start_wait_s: float = 1.0,
        max_request_targets: int = 1000,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
        make_channel: Callable[[str], grpc.aio.Channel] = clients.channel,
    ) -> None:
        self._mode, self._names = parse_targets(targets)
        self._on_results = on_results
        self._on_stale = on_stale
        self._streams_per_prober = max(1, streams_per_prober)
        self._connect_timeout_s = connect_timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._resolve_interval_s = resolve_interval_s
        self._start_wait_s = start_wait_s
        self._max_request_targets = max(1, max_request_targets)
        self._liveness_timeout_s = liveness_timeout_s
        self._make_channel = make_channel
        self._placement = probe_placement.Placement()
        self._probers: dict[str, _Prober] = {}
        self._stale = True
        self._reported_stale: bool | None = None
        self._started = False
        self._stopping = False
        self._first_live = asyncio.Event()
        self._resolver: asyncio.Task[None] | None = None
        self._pending_unavailable: list[pb.ProbeResult] = []
        self._flush_scheduled = False
        self._background: set[asyncio.Task[None]] = set()

    # Public API -------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        """True while no prober is reachable (no stream is live)."""
        return self._stale

    async def start(self) -> None:
        """Connect to every prober; wait up to start_wait_s for the first live stream."""
        if self._mode == "dns":
            await self._resolve_once()
            self._resolver = asyncio.get_running_loop().create_task(self._resolve_loop())
        else:
            self._set_probers(self._names)
        await waits.wait_event(self._first_live, self._start_wait_s)
        self._started = True
        if not self._placement.live:
            self._mark_unavailable(list(self._placement.unassigned), "no prober reachable", "")
        self._report_stale()

    async def stop(self) -> None:
        """Close every stream and channel. No callback is called afterwards."""
        self._stopping = True
        if self._resolver is not None:
            self._resolver.cancel()
        streams = [s for p in self._probers.values() for s in p.streams]
        for stream in streams:
            if stream.call is not None:
                stream.call.cancel()
            if stream.task is not None:
                stream.task.cancel()
        tasks = [s.task for s in streams if s.task is not None]
        if tasks:
            # Bounded: a stop must never hang on a prober that does not answer.
            await asyncio.wait(tasks, timeout=self._connect_timeout_s)
        for prober in self._probers.values():
            await prober.channel.close()
        self._probers.clear()

    def upsert(self, target: pb.ProbeTarget) -> None:
        """Add a target or change it; the change reaches its prober at once. Never blocks."""
        copy = pb.ProbeTarget()
        copy.CopyFrom(target)
        target_id = copy.target_id
        placement = self._placement
        if placement.targets.get(target_id) == copy and target_id in placement.assigned:
            return  # unchanged: the prober already has it
        placement.targets[target_id] = copy
        stream = placement.assigned.get(target_id)
        if stream is not None:
            stream.queue_upsert(copy)
            return
        self._place([target_id], reason="no prober reachable", prober_id="")

    def remove(self, target_id: str) -> None:
        """Stop probing `target_id`; no result for it is delivered after this returns."""
        self._placement.remove(target_id)
        if self._pending_unavailable:
            self._pending_unavailable = [r for r in self._pending_unavailable if r.target_id != target_id]

    def prober_loads(self) -> dict[str, int]:
        """Targets assigned to each prober address, for status pages and tests."""
        return {addr: sum(len(s.targets) for s in prober.streams if s.live) for addr, prober in self._probers.items()}

    # Streams going live and dead ----------------------------------------------------------

    def _place(self, target_ids: list[str], *, reason: str, prober_id: str) -> None:
        """Put targets on the least-loaded live streams, or mark them unavailable."""
        homeless = self._placement.place(target_ids)
        if homeless and self._started:
            self._mark_unavailable(homeless, reason, prober_id)

    def _went_live(self, stream: probe_placement.Stream) -> None:
        self._placement.went_live(stream)
        self._first_live.set()
        self._set_stale(False)

    def _went_dead(self, stream: probe_placement.Stream) -> None:
        if not stream.live:
            return
        moved = self._placement.went_dead(stream)
        if not self._placement.live:
            self._set_stale(True)
        self._place(moved, reason="prober went away", prober_id=stream.prober_id)

    # Results ------------------------------------------------------------------------------

    def _mark_unavailable(self, target_ids: list[str], reason: str, prober_id: str) -> None:
        now = time.time()
        for target_id in target_ids:
            result = pb.ProbeResult(
                target_id=target_id,
                ready=False,
                error=reason,
                prober_id=prober_id,
                outcome=pb.PROBE_OUTCOME_PROBE_UNAVAILABLE,
            )
            result.probe_time.FromNanoseconds(int(now * 1e9))
            self._pending_unavailable.append(result)
        if self._pending_unavailable and not self._flush_scheduled:
            # Deliver from the loop, never from inside the caller's upsert().
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_unavailable)

    def _flush_unavailable(self) -> None:
        self._flush_scheduled = False
        batch = [r for r in self._pending_unavailable if r.target_id in self._placement.unassigned]
        self._pending_unavailable = []
        if batch and not self._stopping:
            self._deliver(batch)

    def _deliver(self, results: list[pb.ProbeResult]) -> None:
        try:
            self._on_results(results)
        except Exception:
            log.exception("probe results callback failed")

    def _set_stale(self, stale: bool) -> None:
        self._stale = stale
        if self._started:
            self._report_stale()

    def _report_stale(self) -> None:
        if self._on_stale is None or self._reported_stale == self._stale or self._stopping:
            return
        self._reported_stale = self._stale
        if self._stale:
            log.warning("no prober reachable: probing is stale")
        else:
            log.info("probers reachable again")
        try:
            self._on_stale(self._stale)
        except Exception:
            log.exception("stale callback failed")

    # Probers and streams -------------------------------------------------------------------

    def _set_probers(self, addresses: list[str]) -> None:
        loop = asyncio.get_running_loop()
        for addr in addresses:
            if addr in self._probers or self._stopping:
                continue
            channel = self._make_channel(addr)
            streams = [probe_placement.Stream(addr=addr, index=i) for i in range(self._streams_per_prober)]
            prober = _Prober(addr=addr, channel=channel, streams=streams)
            self._probers[addr] = prober
            for stream in streams:
                stream.task = loop.create_task(self._run_stream(prober, stream))
        for addr in set(self._probers) - set(addresses):
            prober = self._probers.pop(addr)
            log.info("prober %s left the fleet", addr)
            for stream in prober.streams:
                if stream.task is not None:
                    stream.task.cancel()
                self._went_dead(stream)
            self._placement.prober_left(addr)
            closing = loop.create_task(prober.channel.close())
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)

    async def _resolve_once(self) -> None:
        host, port = _split_host_port(self._names[0])
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("could not resolve the prober fleet name: %s", exc)
            if not self._probers:
                self._set_probers([])
            return
        addresses = sorted({_join_host_port(str(info[4][0]), port) for info in infos})
        self._set_probers(addresses)

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self._resolve_interval_s)
            await self._resolve_once()

    async def _run_stream(self, prober: _Prober, stream: probe_placement.Stream) -> None:
        """Keep one stream open: connect, feed it targets, read results; on a break, hand its
        targets to the live streams and reconnect with backoff."""
        stub = prober_service_pb2_grpc.ProberServiceStub(prober.channel)
        backoff = self._backoff_min_s
        while not self._stopping:
            call = stream.call = stub.Probe()
            writer: asyncio.Task[None] | None = None
            try:
                ident = await self._accepted(call)
                if ident is None or call.done():
                    raise ConnectionError("stream not accepted")
                stream.prober_id = str(ident)
                self._went_live(stream)
                backoff = self._backoff_min_s
                writer = asyncio.get_running_loop().create_task(self._write(stream, call))
                while (response := await self._next_message(call)) is not None:
                    results = [r for r in response.results if self._placement.assigned.get(r.target_id) is stream]
                    if results:
                        self._deliver(results)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, grpc.aio.AioRpcError, ConnectionError) as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc.__class__.__name__
                if stream.live:
                    log.warning("probe stream %s#%d to %s broke: %s", prober.addr, stream.index, stream.prober_id, code)
            finally:
                if writer is not None:
                    writer.cancel()
                call.cancel()
                self._went_dead(stream)
            if self._stopping:
                return
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self._backoff_max_s)

    async def _next_message(self, call: grpc.aio.StreamStreamCall) -> pb.ProbeResponse | None:
        """The next message of a live stream, None at its end.

        Raises:
            TimeoutError: nothing (not even a heartbeat) within the liveness timeout.
        """
        reading = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait({reading}, timeout=self._liveness_timeout_s)
        finally:
            if not reading.done():
                call.cancel()  # as in _accepted: never wait on a prober that does not answer
                reading.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not done:
            raise TimeoutError(f"no message for {self._liveness_timeout_s:g} s")
        response = reading.result()
        return None if response is grpc.aio.EOF else response

    async def _accepted(self, call: grpc.aio.StreamStreamCall) -> str | None:
        """Wait for the prober to accept `call`; its prober id, or None if it did not.

        Not asyncio.wait_for: cancelling grpc's initial_metadata() waits for the metadata, so
        a timeout or a stop() would hang on a prober that never answers. Cancel the call.
        """
        waiting = asyncio.ensure_future(call.initial_metadata())
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self._connect_timeout_s)
        finally:
            if not waiting.done():
                call.cancel()
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not done:
            raise TimeoutError("stream not accepted in time")
        value = dict(waiting.result() or ()).get(PROBER_ID_METADATA)
        return None if value is None else str(value)

    async def _write(self, stream: probe_placement.Stream, call: grpc.aio.StreamStreamCall) -> None:
        """Send the stream's queued target changes, coalesced into few messages."""
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                while stream.upserts or stream.removes:
                    request = pb.ProbeRequest(remove_target_ids=sorted(stream.removes))
                    stream.removes.clear()
                    while stream.upserts and len(request.upsert_targets) < self._max_request_targets:
                        _, target = stream.upserts.popitem()
                        request.upsert_targets.append(target)
                    await call.write(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The reader sees the same break and handles it.
            log.debug("probe stream write failed: %s", exc.__class__.__name__)
