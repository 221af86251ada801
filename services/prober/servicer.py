"""ProberService servicer: a thin adapter between the Probe stream and probe streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Literal

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from replicaplane.prober.v1 import prober_service_pb2 as pb
from replicaplane.prober.v1 import prober_service_pb2_grpc
from services.common import pbtime, probe_fleet
from services.prober import probing, streams

log = logging.getLogger(__name__)

# Sent as soon as a stream is accepted: the fleet client takes it as "this stream is live".
PROBER_ID_METADATA = probe_fleet.PROBER_ID_METADATA

_METHODS = {pb.PROBE_METHOD_UNSPECIFIED: "GET", pb.PROBE_METHOD_GET: "GET", pb.PROBE_METHOD_POST: "POST"}
_OUTCOMES = {
    probing.Outcome.READY: pb.PROBE_OUTCOME_READY,
    probing.Outcome.REPLICA_FAILURE: pb.PROBE_OUTCOME_REPLICA_FAILURE,
    probing.Outcome.INVALID_TARGET: pb.PROBE_OUTCOME_INVALID_TARGET,
}


def _seconds(message: pb.ProbeTarget, field: Literal["timeout", "interval", "fast_interval"]) -> float | None:
    if not message.HasField(field):
        return None
    return pbtime.seconds(getattr(message, field))


def spec_from_proto(target: pb.ProbeTarget) -> probing.TargetSpec:
    """The domain form of a proto target (not yet validated)."""
    return probing.TargetSpec(
        target_id=target.target_id,
        url=target.url,
        path=target.path,
        method=_METHODS.get(target.method, "UNKNOWN"),
        post_data_json=target.post_data_json,
        headers=dict(target.headers),
        timeout_s=_seconds(target, "timeout"),
        interval_s=_seconds(target, "interval"),
        fast_interval_s=_seconds(target, "fast_interval"),
        starting=target.starting,
        traceparent=target.traceparent,
    )


def result_to_proto(result: probing.Result, prober_id: str) -> pb.ProbeResult:
    """The proto form of a domain result."""
    latency_ns = int(result.latency_s * 1e9)
    time_ns = int(result.probe_time * 1e9)
    return pb.ProbeResult(
        target_id=result.target_id,
        ready=result.outcome is probing.Outcome.READY,
        http_code=result.http_code,
        latency=duration_pb2.Duration(seconds=latency_ns // 1_000_000_000, nanos=latency_ns % 1_000_000_000),
        error=result.error,
        probe_time=timestamp_pb2.Timestamp(seconds=time_ns // 1_000_000_000, nanos=time_ns % 1_000_000_000),
        prober_id=prober_id,
        outcome=_OUTCOMES[result.outcome],
    )


class ProberServicer(prober_service_pb2_grpc.ProberServiceServicer):
    """Serves Probe streams from an Engine.

    Args:
        engine: the process's probe streams.
        prober_id: this prober's identity, stamped on every result.
        heartbeat_s: a stream quiet this long gets an empty message (a heartbeat).
    """

    def __init__(self, engine: streams.Engine, prober_id: str, *, heartbeat_s: float = 1.0) -> None:
        self._engine = engine
        self._prober_id = prober_id
        self._heartbeat_s = heartbeat_s

    async def Probe(
        self, request_iterator: AsyncIterator[pb.ProbeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProbeResponse]:
        """Apply target changes as they come; stream result batches until the client leaves."""
        stream = self._engine.open_stream()
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator, stream))
        # Read once: after the call ends the context may no longer answer (it raised in teardown).
        peer = context.peer()
        log.info("probe stream opened by %s", peer)
        try:
            await context.send_initial_metadata(((PROBER_ID_METADATA, self._prober_id),))
            # An empty batch is a heartbeat: the stream was quiet for heartbeat_s.
            while (batch := await stream.next_batch(self._heartbeat_s)) is not None:
                yield pb.ProbeResponse(
                    results=[result_to_proto(r, self._prober_id) for r in batch], prober_id=self._prober_id
                )
        finally:
            reader.cancel()
            log.info("probe stream of %s closed (%d targets)", peer, stream.target_count)
            self._engine.close_stream(stream)

    @staticmethod
    async def _read(requests: AsyncIterator[pb.ProbeRequest], stream: streams.ProbeStream) -> None:
        # The client half-closing only means "no more changes": keep probing until it leaves.
        try:
            async for request in requests:
                for target_id in request.remove_target_ids:
                    stream.remove(target_id)
                for target in request.upsert_targets:
                    stream.upsert(spec_from_proto(target))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("probe stream reader ended: %s", exc.__class__.__name__)
