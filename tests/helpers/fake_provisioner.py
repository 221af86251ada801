"""A scripted ProvisionerService for controller tests that need failures the local backend
cannot produce on demand (a teardown that fails, a launch held in flight). Replicas are not
processes: every launch "runs" at one shared endpoint that the test serves."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2 as res
from services.common import grpc_server, multiplex, pbtime


class FakeProvisioner(pb_grpc.ProvisionerServiceServicer):
    """Launches succeed at `endpoint` (or all fail for capacity while `capacity_refused`);
    names in `fail_teardown` fail every teardown. While `hold_launches` is set, new launches
    stay PROVISIONING until cancelled; while `dead_endpoint` is set, new replicas run at an
    endpoint nothing answers. Each entry of `failing_launches` ((message, cause), oldest first)
    fails one new launch, not for capacity. A teardown takes `teardown_s` seconds."""

    def __init__(self, endpoint: str, *, endpoint_per_replica: bool = False, launch_many: bool = True) -> None:
        self.endpoint = endpoint
        # False: LaunchMany, LaunchBatches and TerminateBatches are UNIMPLEMENTED (an older
        # provisioner).
        self.launch_many = launch_many
        self.streams: collections.Counter[str] = collections.Counter()  # calls of each launch RPC
        self.teardown_streams: collections.Counter[str] = collections.Counter()  # and teardown RPC
        # Each replica at `endpoint/r/<name>`, so the requests seen tell which replica was probed.
        self.endpoint_per_replica = endpoint_per_replica
        self.requests: dict[str, float] = {}  # request path -> time.monotonic() of its last request
        self.fail_teardown: set[str] = set()
        self.capacity_refused = False
        self.hold_launches = False
        self.dead_endpoint = False
        self.honour_drain = False  # True: a Terminate waits its drain, unless one without drain cuts it
        self._drains: dict[str, asyncio.Event] = {}
        self.teardown_s = 0.0
        self.failing_launches: list[tuple[str, int]] = []
        self.launches: collections.Counter[str] = collections.Counter()
        self.traceparents: list[str] = []  # the trace context each Launch call carried ("" for none)
        self.launch_times: dict[str, float] = {}  # name -> time.monotonic() of its first Launch
        self.specs: dict[str, spec_pb2.ServiceSpec] = {}  # name -> the spec of its last Launch
        self.terminations: collections.Counter[str] = collections.Counter()
        self.zone_lists = 0  # ListZones calls
        self.running: dict[str, res.ProvisionedReplica] = {}
        self._watchers: set[asyncio.Queue[res.ReplicaEvent]] = set()
        self._sequence = 0

    def _event(self, type_: int, replica: res.ProvisionedReplica, **fields: object) -> res.LaunchEvent:
        self._sequence += 1
        return res.LaunchEvent(
            sequence=self._sequence, time=pbtime.timestamp(time.time()), type=type_, replica=replica, **fields
        )

    async def Launch(
        self, request: pb.LaunchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchResponse]:
        self.streams["Launch"] += 1
        async for response in self._launch(request, context):
            yield response

    async def LaunchMany(
        self, request_iterator: AsyncIterator[pb.LaunchManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchManyResponse]:
        if not self.launch_many:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no LaunchMany here")
        self.streams["LaunchMany"] += 1
        requests = multiplex.launch_requests(request_iterator)
        events = self._events_of(context)
        async for response in multiplex.serve(requests, events, multiplex.launch_response, domain="provisioner.test"):
            yield response

    async def LaunchBatches(
        self, request_iterator: AsyncIterator[pb.LaunchBatchesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchBatchesResponse]:
        if not self.launch_many:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no LaunchBatches here")
        self.streams["LaunchBatches"] += 1
        requests = multiplex.launch_batch_requests(request_iterator)
        events = self._events_of(context)
        batches = multiplex.serve_batches(requests, events, multiplex.launch_response, domain="provisioner.test")
        async for batch in batches:
            yield pb.LaunchBatchesResponse(responses=batch)

    def _events_of(
        self, context: grpc.aio.ServicerContext
    ) -> Callable[[pb.LaunchRequest], AsyncIterator[res.LaunchEvent]]:
        async def events(request: pb.LaunchRequest) -> AsyncIterator[res.LaunchEvent]:
            async for response in self._launch(request, context):
                yield response.event

        return events

    async def _launch(
        self, request: pb.LaunchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LaunchResponse]:
        self.launch_times.setdefault(request.name, time.monotonic())
        metadata = dict(context.invocation_metadata() or ())
        self.traceparents.append(str(metadata.get("traceparent", "")))
        self.specs[request.name] = request.spec
        replica = self.running.get(request.name)
        if replica is None and self.capacity_refused:
            self.launches[request.name] += 1
            failed = res.ProvisionedReplica(name=request.name, state=res.REPLICA_STATE_FAILED)
            yield pb.LaunchResponse(event=self._event(res.LAUNCH_EVENT_TYPE_QUEUED, failed))
            # As the real one: capacity is the infrastructure's fault, never permanent.
            refusal = {
                "message": "no capacity",
                "capacity_unavailable": True,
                "cause": res.FAILURE_CAUSE_INFRASTRUCTURE,
            }
            yield pb.LaunchResponse(event=self._event(res.LAUNCH_EVENT_TYPE_FAILED, failed, **refusal))
            return
        if replica is None and self.failing_launches:
            self.launches[request.name] += 1
            message, cause = self.failing_launches.pop(0)
            failed = res.ProvisionedReplica(name=request.name, state=res.REPLICA_STATE_FAILED)
            yield pb.LaunchResponse(event=self._event(res.LAUNCH_EVENT_TYPE_QUEUED, failed))
            yield pb.LaunchResponse(
                event=self._event(res.LAUNCH_EVENT_TYPE_FAILED, failed, message=message, cause=cause)
            )
            return
        if replica is None:
            self.launches[request.name] += 1
            replica = res.ProvisionedReplica(
                name=request.name,
                service=request.service,
                replica_id=request.replica_id,
                version=request.version,
                state=res.REPLICA_STATE_RUNNING,
                app_state=res.APP_STATE_RUNNING,
                endpoint="http://127.0.0.1:9" if self.dead_endpoint else self._endpoint_of(request.name),
                zone="zone-a",
                create_time=pbtime.timestamp(time.time()),
                owner=request.owner,
            )
            self.running[request.name] = replica
        yield pb.LaunchResponse(event=self._event(res.LAUNCH_EVENT_TYPE_QUEUED, replica))
        yield pb.LaunchResponse(event=self._event(res.LAUNCH_EVENT_TYPE_PROVISIONING, replica, attempt=1))
        if self.hold_launches:
            await asyncio.Event().wait()  # until the caller cancels the stream
        yield pb.LaunchResponse(
            event=self._event(res.LAUNCH_EVENT_TYPE_RUNNING, replica, attempt=1, endpoint=replica.endpoint)
        )

    def _endpoint_of(self, name: str) -> str:
        return f"{self.endpoint}/r/{name}" if self.endpoint_per_replica else self.endpoint

    async def Terminate(
        self, request: pb.TerminateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TerminateResponse]:
        self.teardown_streams["Terminate"] += 1
        async for event in self._terminate(request):
            yield pb.TerminateResponse(event=event)

    async def TerminateBatches(
        self, request_iterator: AsyncIterator[pb.TerminateBatchesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TerminateBatchesResponse]:
        if not self.launch_many:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no TerminateBatches here")
        self.teardown_streams["TerminateBatches"] += 1
        requests = multiplex.terminate_batch_requests(request_iterator)
        batches = multiplex.serve_batches(
            requests, self._terminate, multiplex.terminate_response, domain="provisioner.test"
        )
        async for batch in batches:
            yield pb.TerminateBatchesResponse(responses=batch)

    async def _terminate(self, request: pb.TerminateRequest) -> AsyncIterator[res.TerminateEvent]:
        self.terminations[request.name] += 1
        now = pbtime.timestamp(time.time())
        yield res.TerminateEvent(sequence=1, time=now, type=res.TERMINATE_EVENT_TYPE_TERMINATING)
        drain = pbtime.seconds(request.drain) if request.HasField("drain") else 0.0
        if self.honour_drain and drain > 0:
            cut = self._drains.setdefault(request.name, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut.wait(), drain)
            self._drains.pop(request.name, None)
        elif request.name in self._drains:
            self._drains[request.name].set()  # as the real provisioner: a second call ends the drain
        if request.name in self.fail_teardown:
            yield res.TerminateEvent(
                sequence=2, time=now, type=res.TERMINATE_EVENT_TYPE_FAILED, message="cloud said no"
            )
            return
        await asyncio.sleep(self.teardown_s)
        self.running.pop(request.name, None)
        yield res.TerminateEvent(sequence=2, time=now, type=res.TERMINATE_EVENT_TYPE_TERMINATED)

    async def CheckSpec(self, request: pb.CheckSpecRequest, context: grpc.aio.ServicerContext) -> pb.CheckSpecResponse:
        return pb.CheckSpecResponse()  # it runs anything

    async def ListZones(self, request: pb.ListZonesRequest, context: grpc.aio.ServicerContext) -> pb.ListZonesResponse:
        self.zone_lists += 1
        return pb.ListZonesResponse()  # no zones: the backend places spot replicas

    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListReplicasResponse:
        names = sorted(n for n, r in self.running.items() if not request.service or r.service == request.service)
        return pb.ListReplicasResponse(replicas=[self.running[n] for n in names])

    async def WatchReplicas(
        self, request: pb.WatchReplicasRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchReplicasResponse]:
        q: asyncio.Queue[res.ReplicaEvent] = asyncio.Queue()
        self._watchers.add(q)
        try:
            for replica in list(self.running.values()):
                yield pb.WatchReplicasResponse(
                    event=res.ReplicaEvent(type=res.REPLICA_EVENT_TYPE_SNAPSHOT, replica=replica)
                )
            yield pb.WatchReplicasResponse(event=res.ReplicaEvent(type=res.REPLICA_EVENT_TYPE_SNAPSHOT_END))
            while True:
                yield pb.WatchReplicasResponse(event=await q.get())
        finally:
            self._watchers.discard(q)

    async def StreamLogs(
        self, request: pb.StreamLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamLogsResponse]:
        if request.name not in self.running:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no logs of {request.name}")
        kind = res.LogKind.Name(request.kind)
        yield pb.StreamLogsResponse(data=f"{kind} of {request.name}\n".encode())
        if request.follow:
            yield pb.StreamLogsResponse(data=b"more\n")

    def app_exited(self, name: str, code: int) -> None:
        """Report that a replica's app exited."""
        replica = self.running[name]
        replica.app_state = res.APP_STATE_EXITED
        replica.exit_code = code
        for q in self._watchers:
            q.put_nowait(res.ReplicaEvent(type=res.REPLICA_EVENT_TYPE_APP_EXITED, replica=replica))


class _Replicas(asyncio.Protocol):
    """Every replica's HTTP endpoint: 200 "ok" to any request, over kept-alive connections,
    noting the time of each path's last request. Plain asyncio: at 10,000 replicas a web
    framework's cost per request was a large share of the scale bench's CPU."""

    def __init__(self, requests: dict[str, float]) -> None:
        self._requests = requests
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return  # the body is not all here yet
            self._buffer = self._buffer[end + 4 + length :]
            parts = head[0].split(" ")
            if len(parts) >= 2:
                self._requests[parts[1].split("?")[0]] = time.monotonic()
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")


@contextlib.asynccontextmanager
async def serving(
    *, endpoint_per_replica: bool = False, launch_many: bool = True
) -> AsyncIterator[tuple[FakeProvisioner, str]]:
    """A FakeProvisioner on a real gRPC server (port 0) whose replicas all answer 200 at one
    local server (each at a path of its own with `endpoint_per_replica`, recorded in
    `requests`); yields it and the provisioner's address."""
    requests: dict[str, float] = {}
    replicas = await asyncio.get_running_loop().create_server(lambda: _Replicas(requests), "127.0.0.1", 0)
    port = replicas.sockets[0].getsockname()[1]
    fake = FakeProvisioner(
        f"http://127.0.0.1:{port}", endpoint_per_replica=endpoint_per_replica, launch_many=launch_many
    )
    fake.requests = requests
    server = grpc_server.new_server(domain="provisioner.test")
    pb_grpc.add_ProvisionerServiceServicer_to_server(fake, server)
    built = grpc_server.finish(server, "127.0.0.1:0", ["replicaplane.provisioner.v1.ProvisionerService"])
    await built.start()
    try:
        yield fake, f"127.0.0.1:{built.port}"
    finally:
        await built.stop(None)
        replicas.close()
