"""Service bootstrap: each real process serves health and reflection and stops on SIGTERM; the
error interceptor maps domain errors to statuses with google.rpc details."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import wrappers_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.common import errors, grpc_errors, grpc_server
from tests.helpers import ports, procs

GRPCURL = os.path.join(os.path.dirname(sys.executable), "grpcurl")

SERVICES = {
    "controller": "replicaplane.controller.v1.ControllerService",
    "provisioner": "replicaplane.provisioner.v1.ProvisionerService",
    "prober": "replicaplane.prober.v1.ProberService",
}


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    """Run grpcurl without any proto files: everything comes from server reflection."""
    return subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_process_serves_health_and_reflection_and_stops_cleanly(name: str, tmp_path) -> None:
    # Never the default peer ports: a controller dialing 127.0.0.1:50052 would join (and reap
    # the replicas of) a `make up` stack running on this machine. A reserved port refuses.
    nowhere = ports.Reserved()
    env = {
        "REPLICAPLANE_CONTROLLER_STATE_DIR": str(tmp_path / "controller"),
        "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": nowhere.addr,
        "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": nowhere.addr,
        "REPLICAPLANE_PROVISIONER_STATE_DIR": str(tmp_path / "provisioner"),
    }
    svc = procs.start_service(name, env=env, workdir=str(tmp_path))
    try:
        listed = grpcurl(svc.addr, "list")
        assert listed.returncode == 0, listed.stderr
        names = listed.stdout.split()
        assert SERVICES[name] in names
        assert "grpc.health.v1.Health" in names

        methods = grpcurl(svc.addr, "list", SERVICES[name])
        assert methods.returncode == 0, methods.stderr
        assert methods.stdout.strip(), "reflection lists the service's methods"

        for service in ("", SERVICES[name]):
            check = grpcurl("-d", json.dumps({"service": service}), svc.addr, "grpc.health.v1.Health/Check")
            assert check.returncode == 0, check.stderr
            assert json.loads(check.stdout) == {"status": "SERVING"}

        svc.proc.send_signal(signal.SIGTERM)
        # The task's bound: a clean stop within 5 s (TimeoutExpired fails the test).
        assert svc.proc.wait(timeout=5) == 0
        assert "Traceback" not in svc.log()
    finally:
        svc.stop()
        nowhere.close()
    assert svc.proc.poll() is not None


# --- error interceptor, through a test-only service on a real server -------------------------

DOMAIN = "test.replicaplane"
VIOLATIONS = [
    errors.FieldViolation("service.replicas", "must be at least 1"),
    errors.FieldViolation("service.readiness_probe.path", "must start with '/'"),
    errors.FieldViolation("resources.ports", "exactly one port is needed"),
]


def _raise(kind: str) -> None:
    if kind == "validation":
        raise errors.ValidationError(VIOLATIONS, subject="service spec")
    if kind == "not_found":
        raise errors.NotFoundError("service hello not found", reason="SERVICE_NOT_FOUND", service="hello")
    if kind == "exists":
        raise errors.AlreadyExistsError("service hello already exists", reason="SERVICE_EXISTS", service="hello")
    if kind == "precondition":
        raise errors.FailedPreconditionError(
            "service hello is shutting down", subject="services/hello", reason="SERVICE_SHUTTING_DOWN"
        )
    if kind == "aborted":
        raise errors.AbortedError("concurrent change", reason="CONFLICT")
    if kind == "unavailable":
        raise errors.UnavailableError("provisioner unreachable", reason="PROVISIONER_UNAVAILABLE")
    raise RuntimeError("boom: token=hunter2 at /secret/path")


async def _unary(request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext) -> wrappers_pb2.StringValue:
    _raise(request.value)
    return request


async def _stream(
    request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext
) -> AsyncIterator[wrappers_pb2.StringValue]:
    yield wrappers_pb2.StringValue(value="first")
    _raise(request.value)


@pytest.fixture
async def errors_channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc_server.new_server(domain=DOMAIN)
    kwargs = {
        "request_deserializer": wrappers_pb2.StringValue.FromString,
        "response_serializer": wrappers_pb2.StringValue.SerializeToString,
    }
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Errors",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(_unary, **kwargs),
                    "Stream": grpc.unary_stream_rpc_method_handler(_stream, **kwargs),
                },
            )
        ]
    )
    built = grpc_server.finish(server, "127.0.0.1:0", ["test.Errors"])
    await built.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
        yield channel
    await built.stop(None)


async def _call(channel: grpc.aio.Channel, method: str, kind: str) -> grpc.aio.AioRpcError:
    kwargs = {
        "request_serializer": wrappers_pb2.StringValue.SerializeToString,
        "response_deserializer": wrappers_pb2.StringValue.FromString,
    }
    request = wrappers_pb2.StringValue(value=kind)
    try:
        if method == "Unary":
            await channel.unary_unary("/test.Errors/Unary", **kwargs)(request, timeout=10)
        else:
            received = [
                r.value async for r in channel.unary_stream("/test.Errors/Stream", **kwargs)(request, timeout=10)
            ]
            pytest.fail(f"stream ended without an error after {received}")
    except grpc.aio.AioRpcError as err:
        return err
    pytest.fail("the call succeeded")


def _details(err: grpc.aio.AioRpcError) -> dict[str, object]:
    status = rpc_status.from_call(err)
    assert status is not None, "the status carries google.rpc details"
    found: dict[str, object] = {}
    for detail in status.details:
        for cls in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.PreconditionFailure,
        ):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                found[cls.__name__] = message
    return found


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_validation_error_is_invalid_argument_with_every_field_violation(errors_channel, method) -> None:
    err = await _call(errors_channel, method, "validation")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = _details(err)
    bad = details["BadRequest"]
    assert [(v.field, v.description) for v in bad.field_violations] == [(v.field, v.description) for v in VIOLATIONS]
    info = details["ErrorInfo"]
    assert (info.reason, info.domain) == ("INVALID_ARGUMENT", DOMAIN)
    decoded = grpc_errors.RpcError(err)
    assert decoded.reason == "INVALID_ARGUMENT"
    assert len(decoded.field_violations) == 3


@pytest.mark.parametrize("method", ["Unary", "Stream"])
@pytest.mark.parametrize(
    ("kind", "code", "reason"),
    [
        ("not_found", grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND"),
        ("exists", grpc.StatusCode.ALREADY_EXISTS, "SERVICE_EXISTS"),
        ("precondition", grpc.StatusCode.FAILED_PRECONDITION, "SERVICE_SHUTTING_DOWN"),
        ("aborted", grpc.StatusCode.ABORTED, "CONFLICT"),
        ("unavailable", grpc.StatusCode.UNAVAILABLE, "PROVISIONER_UNAVAILABLE"),
    ],
)
async def test_domain_errors_map_to_their_codes_with_error_info(errors_channel, method, kind, code, reason) -> None:
    err = await _call(errors_channel, method, kind)
    assert err.code() == code
    info = _details(err)["ErrorInfo"]
    assert (info.reason, info.domain) == (reason, DOMAIN)
    assert grpc_errors.RpcError(err).reason == reason


async def test_not_found_error_info_carries_the_named_values(errors_channel) -> None:
    err = await _call(errors_channel, "Unary", "not_found")
    assert dict(_details(err)["ErrorInfo"].metadata) == {"service": "hello"}


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_failed_precondition_carries_precondition_failure(errors_channel, method) -> None:
    err = await _call(errors_channel, method, "precondition")
    violation = _details(err)["PreconditionFailure"].violations[0]
    assert (violation.type, violation.subject) == ("STATE", "services/hello")


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_unexpected_exception_is_internal_with_a_generic_message(errors_channel, method, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="services.common.grpc_errors"):
        err = await _call(errors_channel, method, "boom")
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "internal error"
    assert "hunter2" not in str(err.debug_error_string()) + str(err.trailing_metadata())
    # The traceback goes to the server log instead.
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)
