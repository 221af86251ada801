"""A test-only stand-in for the controller that serves endpoints with per-version weights.

The real controller cannot split traffic between versions yet (that comes with the rollout
work), so balancer tests and the balancer benchmark use this: it serves GetService,
WatchEndpoints with `version_weights`, and ReportLoad with the real controller's exactly-once rule
(a sequence at or below the last applied one from a balancer id is `already_applied`). Replicas
are tiny HTTP apps that answer with their version.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res


class WeightedController(api_grpc.ControllerServiceServicer):
    """Serves one service's endpoints with weights, and takes load reports once per sequence."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.addr = ""
        self.endpoints = api.WatchEndpointsResponse(version=1)
        self.changed = asyncio.Event()
        self.ledger: dict[str, int] = {}
        self.applied: list[api.ReportLoadRequest] = []
        self.duplicates: list[api.ReportLoadRequest] = []
        self.lose_next_answer = False
        """Apply the next report carrying stats, then fail the call, as if the answer was lost."""

    def publish(self, endpoints: list[res.Endpoint], weights: dict[int, int]) -> None:
        """A new endpoint set with these weights, pushed to every watcher."""
        self.endpoints = api.WatchEndpointsResponse(
            version=self.endpoints.version + 1,
            endpoints=endpoints,
            version_weights=[res.VersionWeight(version=v, weight=w) for v, w in weights.items()],
        )
        self.changed.set()

    async def GetService(
        self, request: api.GetServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.GetServiceResponse:
        svc = res.Service(name=self.service, latest_version=100)
        svc.spec.service.replica_policy.min_replicas = 1
        return api.GetServiceResponse(service=svc)

    async def WatchEndpoints(
        self, request: api.WatchEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchEndpointsResponse]:
        sent = 0
        while True:
            if self.endpoints.version != sent:
                sent = self.endpoints.version
                yield self.endpoints
            self.changed.clear()
            await self.changed.wait()

    async def ReportLoad(
        self, request: api.ReportLoadRequest, context: grpc.aio.ServicerContext
    ) -> api.ReportLoadResponse:
        if request.sequence <= self.ledger.get(request.balancer_id, 0):
            self.duplicates.append(request)
            return api.ReportLoadResponse(already_applied=True)
        self.ledger[request.balancer_id] = request.sequence
        self.applied.append(request)
        if self.lose_next_answer and request.version_stats:
            self.lose_next_answer = False
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost")
        return api.ReportLoadResponse(counted_requests=len(request.request_ages))

    def totals(self) -> dict[int, tuple[int, int, int, int]]:
        """Version -> (requests, 5xx, transport errors, latencies) over the applied reports."""
        out: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
        for report in self.applied:
            for s in report.version_stats:
                t = out[s.version]
                t[0] += s.requests
                t[1] += s.server_errors
                t[2] += s.transport_errors
                t[3] += sum(s.latency_buckets.values())
        return {v: (t[0], t[1], t[2], t[3]) for v, t in out.items()}


@contextlib.asynccontextmanager
async def serving(service: str) -> AsyncIterator[WeightedController]:
    """The stand-in on 127.0.0.1, port 0 (its address in `.addr`)."""
    ctl = WeightedController(service)
    server = grpc.aio.server()
    api_grpc.add_ControllerServiceServicer_to_server(ctl, server)
    ctl.addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield ctl
    finally:
        await server.stop(None)


def version_app(version: int, status: int = 200) -> web.Application:
    """A replica app answering every request with `status` and `version N`."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=status, text=f"version {version}\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


class Replicas:
    """Version apps served in this process, each on its own port on 127.0.0.1."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.next_id = 1

    async def start(self, version: int, *, status: int = 200) -> res.Endpoint:
        """A new replica of `version`; its endpoint as the controller would announce it."""
        runner = web.AppRunner(version_app(version, status), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        rid, self.next_id = self.next_id, self.next_id + 1
        return res.Endpoint(replica_id=rid, url=f"http://127.0.0.1:{runner.addresses[0][1]}", version=version)

    async def close(self) -> None:
        """Stop every replica."""
        for runner in self.runners:
            await runner.cleanup()
        self.runners = []
