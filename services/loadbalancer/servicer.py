"""LoadBalancerService over gRPC: the balancer's view of a service, for operators and tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grpc

from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as api_grpc
from services.common import errors
from services.loadbalancer import fleet as fleet_mod

_MAX_NAMES_SHOWN = 20


def pick(units: Mapping[str, fleet_mod.Unit], name: str, *, fleet: bool) -> fleet_mod.Unit | None:
    """The unit a GetBalancer request names (empty: the only one; None for a fleet serving none).

    Raises:
        errors.ValidationError: a fleet serves several services and none is named.
        errors.NotFoundError: no such service is served here.
    """
    if not name and len(units) == 1:
        return next(iter(units.values()))
    if not name and not units:
        return None
    if not name:
        served = sorted(units)
        listed = ", ".join(served[:_MAX_NAMES_SHOWN]) + (", ..." if len(served) > _MAX_NAMES_SHOWN else "")
        raise errors.ValidationError(
            [errors.FieldViolation("service_name", f"required: this fleet serves {len(served)} services ({listed})")]
        )
    unit = units.get(name)
    if unit is None:
        what = "this fleet serves no service" if fleet else "this balancer does not serve service"
        raise errors.NotFoundError(
            f"{what} {name[:100]!r} (not created yet, a pool, or just deleted)",
            reason="SERVICE_NOT_SERVED",
            service=name[:100],
        )
    return unit


class LoadBalancerServicer(api_grpc.LoadBalancerServiceServicer):
    """Reads the balancers' state; changes nothing."""

    def __init__(self, units: Callable[[], Mapping[str, fleet_mod.Unit]], *, fleet: bool = False) -> None:
        self._units = units
        self._fleet = fleet

    async def GetBalancer(
        self, request: api.GetBalancerRequest, context: grpc.aio.ServicerContext
    ) -> api.GetBalancerResponse:
        units = self._units()
        unit = pick(units, request.service_name, fleet=self._fleet)
        if unit is None:  # a fleet with no service yet: nothing but what it is
            return api.GetBalancerResponse(fleet=self._fleet)
        return view_of(unit, served=sorted(units), fleet=self._fleet)


def view_of(unit: fleet_mod.Unit, *, served: list[str], fleet: bool) -> api.GetBalancerResponse:
    """The admin view of one service's balancer."""
    b, link = unit.balancer, unit.link
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
        url=link.url,
        endpoints_version=b.endpoints_version,
        replicas=replicas,
        held_requests=b.held,
        unreported_requests=link.unreported,
        controller_connected=link.connected,
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
        served_services=served,
        fleet=fleet,
    )
