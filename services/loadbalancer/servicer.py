"""LoadBalancerService over gRPC: the balancer's view, for operators and tests."""

from __future__ import annotations

import grpc

from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as api_grpc
from services.loadbalancer import balancer as bal
from services.loadbalancer import link as ctl_link


class LoadBalancerServicer(api_grpc.LoadBalancerServiceServicer):
    """Reads the balancer's state; changes nothing."""

    def __init__(self, balancer: bal.Balancer, link: ctl_link.ControllerLink) -> None:
        self._bal = balancer
        self._link = link

    async def GetBalancer(
        self, request: api.GetBalancerRequest, context: grpc.aio.ServicerContext
    ) -> api.GetBalancerResponse:
        b = self._bal
        replicas = [
            api.ReplicaLoad(
                replica_id=rid,
                url=r.url if r is not None else "",
                in_flight=b.in_flight.get(rid),
                ready=ready,
                requests_total=b.in_flight.totals.get(rid, 0),
            )
            for rid, (r, ready) in sorted(b.replicas().items())
        ]
        return api.GetBalancerResponse(
            service_name=b.service_name,
            policy=b.policy.name,
            url=self._link.url,
            endpoints_version=b.endpoints_version,
            replicas=replicas,
            held_requests=b.held,
            unreported_requests=self._link.unreported,
            controller_connected=self._link.connected,
            versions=[
                api.VersionTraffic(
                    version=v.version,
                    weight=v.weight,
                    share_per_mille=v.share_per_mille,
                    ready_replicas=v.ready_replicas,
                    requests_total=v.totals.requests,
                    server_errors_total=v.totals.server_errors,
                    transport_errors_total=v.totals.transport_errors,
                )
                for v in b.versions_view()
            ],
            split_by_version=b.split is not None,
        )
