"""gRPC adapter of the provisioner: request proto -> domain call -> response proto."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2
from services.common import multiplex
from services.provisioner import convert, manager

DOMAIN = "provisioner.replicaplane"

Req = TypeVar("Req")
Item = TypeVar("Item")
Out = TypeVar("Out")
Batch = TypeVar("Batch")


async def _batches(
    requests: AsyncIterable[tuple[str, Req | None]],
    start: Callable[[Req], AsyncIterator[Item]],
    wrap: Callable[[str, Item | multiplex.Ended], Out],
    message: Callable[..., Batch],
) -> AsyncIterator[Batch]:
    """One `*Batches` stream: the inner streams `requests` start, each batch of responses in one `message`."""
    async for batch in multiplex.serve_batches(requests, start, wrap, domain=DOMAIN):
        yield message(responses=batch)


class ProvisionerServicer(pb_grpc.ProvisionerServiceServicer):
    """Thin adapter over manager.Provisioner; domain errors map to statuses in the interceptor."""

    def __init__(self, provisioner: manager.Provisioner) -> None:
        self._p = provisioner

    async def Launch(
        self, request: pb.LaunchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchResponse]:
        events = self._p.launch(
            convert.launch_request(request),
            after_sequence=request.after_sequence,
            attach_only=request.attach_only,
        )
        async for event in events:
            yield convert.launch_event(event)

    async def LaunchMany(
        self, request_iterator: AsyncIterator[pb.LaunchManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchManyResponse]:
        async for response in multiplex.serve(
            multiplex.launch_requests(request_iterator), self._launch_events, multiplex.launch_response, domain=DOMAIN
        ):
            yield response

    async def LaunchBatches(
        self, request_iterator: AsyncIterator[pb.LaunchBatchesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchBatchesResponse]:
        requests = multiplex.launch_batch_requests(request_iterator)
        async for response in _batches(
            requests, self._launch_events, multiplex.launch_response, pb.LaunchBatchesResponse
        ):
            yield response

    async def _launch_events(self, request: pb.LaunchRequest) -> AsyncIterator[resources_pb2.LaunchEvent]:
        events = self._p.launch(
            convert.launch_request(request), after_sequence=request.after_sequence, attach_only=request.attach_only
        )
        async for event in events:
            yield convert.launch_event(event).event

    async def Terminate(
        self, request: pb.TerminateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TerminateResponse]:
        async for event in self._terminate_events(request):
            yield pb.TerminateResponse(event=event)

    async def TerminateBatches(
        self, request_iterator: AsyncIterator[pb.TerminateBatchesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TerminateBatchesResponse]:
        requests = multiplex.terminate_batch_requests(request_iterator)
        async for response in _batches(
            requests, self._terminate_events, multiplex.terminate_response, pb.TerminateBatchesResponse
        ):
            yield response

    async def _terminate_events(self, request: pb.TerminateRequest) -> AsyncIterator[resources_pb2.TerminateEvent]:
        events = self._p.terminate(
            request.name,
            drain_s=convert.seconds(request.drain),
            keep_logs=request.keep_logs,
            after_sequence=request.after_sequence,
        )
        async for event in events:
            yield convert.terminate_event(event).event

    async def CancelLaunch(
        self, request: pb.CancelLaunchRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelLaunchResponse:
        return pb.CancelLaunchResponse(cancelled=await self._p.cancel_launch(request.name))

    async def GetReplica(
        self, request: pb.GetReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetReplicaResponse:
        return pb.GetReplicaResponse(replica=convert.replica(self._p.get(request.name)))

    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListReplicasResponse:
        replicas, token = self._p.list(
            service=request.service, page_size=request.page_size, page_token=request.page_token
        )
        return pb.ListReplicasResponse(replicas=[convert.replica(r) for r in replicas], next_page_token=token)

    async def WatchReplicas(
        self, request: pb.WatchReplicasRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchReplicasResponse]:
        async for event in self._p.watch(request.after_sequence):
            yield convert.replica_event(event)

    async def StreamLogs(
        self, request: pb.StreamLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamLogsResponse]:
        chunks = self._p.stream_logs(
            request.name, convert.log_kind(request.kind), follow=request.follow, job_id=request.job_id
        )
        async for chunk in chunks:
            yield pb.StreamLogsResponse(data=chunk)

    async def PreemptReplica(
        self, request: pb.PreemptReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreemptReplicaResponse:
        return pb.PreemptReplicaResponse(replica=convert.replica(await self._p.preempt(request.name)))

    async def SetZoneAvailability(
        self, request: pb.SetZoneAvailabilityRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetZoneAvailabilityResponse:
        zone = self._p.set_zone_availability(request.zone, convert.seconds(request.refuse_for))
        return pb.SetZoneAvailabilityResponse(zone=convert.zone(zone, time.time()))

    async def ListZones(self, request: pb.ListZonesRequest, context: grpc.aio.ServicerContext) -> pb.ListZonesResponse:
        now = time.time()
        return pb.ListZonesResponse(zones=[convert.zone(z, now) for z in self._p.zones()])

    async def CheckSpec(self, request: pb.CheckSpecRequest, context: grpc.aio.ServicerContext) -> pb.CheckSpecResponse:
        offered = self._p.offered_accelerators()
        return pb.CheckSpecResponse(
            problems=[
                pb.SpecProblem(field=v.field, description=v.description)
                for v in await self._p.check_spec(convert.needs(request.spec))
            ],
            accelerators=[f"{name.upper()}:{count:g}" for name, count in sorted((offered or {}).items())],
            accelerators_limited=offered is not None,
        )

    async def DeleteLogs(
        self, request: pb.DeleteLogsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteLogsResponse:
        return pb.DeleteLogsResponse(deleted=self._p.delete_logs(request.name, job_id=request.job_id))

    async def RunJob(
        self, request: pb.RunJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RunJobResponse]:
        events = self._p.run_job(
            convert.job_request(request), after_sequence=request.after_sequence, attach_only=request.attach_only
        )
        async for event in events:
            yield convert.job_event(event)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        grace = convert.seconds(request.grace) if request.HasField("grace") else None
        cancelled, job = await self._p.cancel_job(request.job_id, grace_s=grace)
        return pb.CancelJobResponse(cancelled=cancelled, job=convert.job(job))

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.GetJobResponse:
        return pb.GetJobResponse(job=convert.job(self._p.get_job(request.job_id)))
