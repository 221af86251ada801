"""Admission of API calls: every check that refuses a request before anything changes (bad
fields, a spec the provisioner cannot run, the replica budget, malformed load reports)."""

from __future__ import annotations

import logging
from typing import TypeVar

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import errors, localpaths, pagetoken, pbtime, spec
from services.controller import balancers, convert
from services.controller.domain import autoscaler, load, placer

log = logging.getLogger(__name__)

T = TypeVar("T", str, int)

CHECK_TIMEOUT_S = 5.0
_MAX_URL = 2048
_MAX_BALANCER_ID = 128


def load_balancer_url_violations(url: str) -> list[errors.FieldViolation]:
    if not url:
        return []
    if len(url) > _MAX_URL or not url.startswith(("http://", "https://")) or not url.isprintable() or " " in url:
        return [
            errors.FieldViolation(
                "load_balancer_url", f"must be an http:// or https:// URL of at most {_MAX_URL} characters"
            )
        ]
    return []


def report_of(request: api.ReportLoadRequest) -> load.Report:
    """A load report as plain values.

    Raises:
        errors.ValidationError: with every malformed field: a negative count, a time or age out of
            protobuf's range (or a negative age), a bad balancer identity or URL.
    """
    violations = []
    if request.request_count < 0:
        violations.append(errors.FieldViolation("request_count", f"must not be negative, got {request.request_count}"))
    violations += [
        errors.FieldViolation(f"request_times[{i}]", problem)
        for i, t in enumerate(request.request_times)
        if (problem := pbtime.timestamp_problem(t))
    ]
    violations += [
        errors.FieldViolation(f"request_ages[{i}]", problem)
        for i, d in enumerate(request.request_ages)
        if (problem := pbtime.duration_problem(d, negative=False))
    ]
    balancer_id, sequence = request.balancer_id, request.sequence
    if len(balancer_id) > _MAX_BALANCER_ID or not balancer_id.isprintable() or any(c.isspace() for c in balancer_id):
        violations.append(
            errors.FieldViolation("balancer_id", f"at most {_MAX_BALANCER_ID} printable characters without spaces")
        )
    if balancer_id and sequence < 1:
        violations.append(errors.FieldViolation("sequence", f"must be at least 1 with balancer_id, got {sequence}"))
    if not balancer_id and sequence:
        violations.append(errors.FieldViolation("balancer_id", "required when sequence is set"))
    violations += load_balancer_url_violations(request.load_balancer_url)
    violations += _in_flight_violations(request)
    errors.require(violations, subject="load report")
    return load.Report(
        balancer_id=balancer_id,
        sequence=sequence,
        ages=[pbtime.seconds(d) for d in request.request_ages],
        times=[pbtime.from_timestamp(t) for t in request.request_times],
        count=request.request_count,
    )


async def check_runnable(
    prov: prov_grpc.ProvisionerServiceStub, parsed: spec_pb2.ServiceSpec, zones: list[tuple[str, float]]
) -> None:
    """Refuse a spec the provisioner cannot run (accelerators, missing workdir), naming fields.

    An unreachable provisioner does not block the API: the launch reports the problem then.
    A zone or region no zone of the provisioner matches is refused too (when its zones are
    known: backends that list none, such as kubernetes, place by the zone label instead).
    A relative workdir or file mount source is refused whatever the provisioner says.
    """
    relative = localpaths.relative_problems(parsed.workdir, parsed.file_mounts)
    hidden = spec.secret_values(parsed)  # a mount destination may hold a substituted secret
    errors.require(
        [errors.FieldViolation(spec.mask_secrets(v.field, hidden), v.description) for v in relative],
        subject="service spec",
    )
    try:
        answer = await prov.CheckSpec(prov_pb.CheckSpecRequest(spec=parsed), timeout=CHECK_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.warning("could not check the spec with the provisioner (%s); accepting it", exc.code().name)
        return
    errors.require(
        [
            errors.FieldViolation(spec.mask_secrets(p.field, hidden), spec.mask_secrets(p.description, hidden))
            for p in answer.problems
        ]
        + [
            errors.FieldViolation(field, spec.mask_secrets(description, hidden))
            for field, description in placer.problems(zones, convert.places_of(parsed))
        ],
        subject="service spec",
    )


def check_budget(name: str, parsed: spec_pb2.ServiceSpec, *, limit: int, current_most: int | None, others: int) -> int:
    """Refuse a spec that would take the services past max_replicas_total; else the most
    replicas it may run.

    Each service holds the most replicas its policy can run (or the replicas it still has,
    if more), so the autoscalers never need to ask. An update that does not raise its
    service's most always passes, even when the limit was lowered below what is held.

    Raises:
        errors.ResourceExhaustedError: naming the spec field that asks for too much.
    """
    want = autoscaler.most_replicas(convert.policy_of(parsed))
    if current_most is not None and want <= current_most:
        return want
    if others + want <= limit:
        return want
    fixed = parsed.service.fixed_replicas_shorthand
    field = "service.replicas" if fixed else "service.replica_policy.max_replicas"
    raise errors.ResourceExhaustedError(
        f"{field}: the service may run up to {want} replicas, but other services hold {others} of the "
        f"controller's max_replicas_total ({limit}), so {max(limit - others, 0)} are left; shrink or "
        "delete a service, or raise the setting",
        reason="REPLICA_BUDGET_EXCEEDED",
        subject=field,
        limit_name="max_replicas_total",
        limit=limit,
        service=name,
        requested=want,
        held_by_others=others,
    )


def check_page_size(page_size: int) -> None:
    if page_size < 0:
        raise errors.ValidationError([errors.FieldViolation("page_size", f"must be >= 0, got {page_size}")])


def check_mode(mode: int) -> list[errors.FieldViolation]:
    if mode in (
        res.UPDATE_MODE_UNSPECIFIED,
        res.UPDATE_MODE_ROLLING,
        res.UPDATE_MODE_BLUE_GREEN,
        res.UPDATE_MODE_CANARY,
    ):
        return []
    return [
        errors.FieldViolation(
            "mode", f"must be UPDATE_MODE_ROLLING, UPDATE_MODE_BLUE_GREEN or UPDATE_MODE_CANARY, got {mode}"
        )
    ]


_MAX_PAGE = 1000


def page(
    keys: list[T], page_size: int, page_token: str, *, kind: str, scope: str, position_type: type[T]
) -> tuple[list[T], str]:
    """One page of sorted `keys` after the page token's position, and the next page's token."""
    check_page_size(page_size)
    if page_token:
        after = pagetoken.decode(page_token, kind, scope, position_type=position_type)
        keys = [k for k in keys if k > after]  # type: ignore[operator]
    size = min(page_size or 100, _MAX_PAGE)
    chunk = keys[:size]
    token = pagetoken.encode(kind, scope, chunk[-1]) if len(keys) > size else ""
    return chunk, token


_MAX_IN_FLIGHT = 10_000


def _in_flight_violations(request: api.ReportLoadRequest) -> list[errors.FieldViolation]:
    if len(request.in_flight) > _MAX_IN_FLIGHT:
        return [errors.FieldViolation("in_flight", f"at most {_MAX_IN_FLIGHT} entries, got {len(request.in_flight)}")]
    violations = []
    if request.endpoints_version < 0:
        violations.append(
            errors.FieldViolation("endpoints_version", f"must not be negative, got {request.endpoints_version}")
        )
    seen: set[int] = set()
    for i, entry in enumerate(request.in_flight):
        if entry.replica_id < 1:
            violations.append(
                errors.FieldViolation(f"in_flight[{i}].replica_id", f"must be >= 1, got {entry.replica_id}")
            )
        elif entry.replica_id in seen:
            violations.append(
                errors.FieldViolation(f"in_flight[{i}].replica_id", f"replica {entry.replica_id} listed twice")
            )
        seen.add(entry.replica_id)
        if entry.requests < 1:
            violations.append(errors.FieldViolation(f"in_flight[{i}].requests", f"must be >= 1, got {entry.requests}"))
    return violations


def balancer_of(request: api.ReportLoadRequest) -> balancers.Report:
    """What a (valid) load report says about its balancer."""
    in_flight = {e.replica_id: e.requests for e in request.in_flight} if request.in_flight_reported else None
    return balancers.Report(
        balancer_id=request.balancer_id,
        url=request.load_balancer_url,
        endpoints_version=request.endpoints_version,
        in_flight=in_flight,
        closing=request.closing,
    )
