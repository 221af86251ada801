"""Domain error to google.rpc.Status mapping, without a server."""

from __future__ import annotations

import pytest
from google.rpc import code_pb2, error_details_pb2

from services.common import errors, grpc_errors


def unpack(status, cls):
    found = []
    for detail in status.details:
        if detail.Is(cls.DESCRIPTOR):
            message = cls()
            detail.Unpack(message)
            found.append(message)
    return found


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.ValidationError([errors.FieldViolation("name", "bad")]), code_pb2.INVALID_ARGUMENT),
        (errors.NotFoundError("gone"), code_pb2.NOT_FOUND),
        (errors.AlreadyExistsError("taken"), code_pb2.ALREADY_EXISTS),
        (errors.FailedPreconditionError("busy"), code_pb2.FAILED_PRECONDITION),
        (errors.AbortedError("raced"), code_pb2.ABORTED),
        (errors.UnavailableError("down"), code_pb2.UNAVAILABLE),
    ],
)
def test_each_domain_error_has_its_code_and_one_error_info(exc, code) -> None:
    status = grpc_errors.to_status(exc, domain="x.replicaplane")
    assert status.code == code
    assert status.message == exc.message
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain) == (exc.reason, "x.replicaplane")


def test_validation_error_lists_every_violation_in_order() -> None:
    violations = [errors.FieldViolation(f"f{i}", f"problem {i}") for i in range(3)]
    status = grpc_errors.to_status(errors.ValidationError(violations), domain="d")
    (bad,) = unpack(status, error_details_pb2.BadRequest)
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("f0", "problem 0"),
        ("f1", "problem 1"),
        ("f2", "problem 2"),
    ]
    assert "f0: problem 0; f1: problem 1; f2: problem 2" in status.message


def test_error_info_metadata_carries_named_values_as_strings() -> None:
    status = grpc_errors.to_status(
        errors.NotFoundError("replica 3 not found", service="hello", replica_id=3), domain="d"
    )
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    assert dict(info.metadata) == {"service": "hello", "replica_id": "3"}


def test_unexpected_exception_is_internal_and_reveals_nothing() -> None:
    status = grpc_errors.to_status(KeyError("token=hunter2"), domain="d")
    assert status.code == code_pb2.INTERNAL
    assert status.message == "internal error"
    assert not status.details


def test_not_implemented_is_unimplemented() -> None:
    status = grpc_errors.to_status(NotImplementedError("Method not implemented!"), domain="d")
    assert status.code == code_pb2.UNIMPLEMENTED


def test_a_thousand_violations_answer_a_short_list_and_the_total() -> None:
    violations = [errors.FieldViolation(f"request_times[{i}]", "nanos must be 0..999,999,999") for i in range(1000)]
    status = grpc_errors.to_status(errors.ValidationError(violations, subject="load report"), domain="d")
    # Statuses travel in a trailer; clients refuse trailers over 8 KB (base64 on the wire).
    assert len(status.SerializeToString()) < 4096
    (bad,) = unpack(status, error_details_pb2.BadRequest)
    fields = [v.field for v in bad.field_violations]
    assert 1 <= len(fields) <= errors.MAX_LISTED_VIOLATIONS
    assert fields == [f"request_times[{i}]" for i in range(len(fields))]
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    assert info.metadata["violation_count"] == "1000"
    assert status.message.endswith("(1000 violations)")


def test_long_violations_are_listed_within_a_byte_budget() -> None:
    violations = [errors.FieldViolation("f" * 300, "d" * 300) for _ in range(50)]
    status = grpc_errors.to_status(errors.ValidationError(violations), domain="d")
    assert len(status.SerializeToString()) < 4096
    (bad,) = unpack(status, error_details_pb2.BadRequest)
    assert len(bad.field_violations) >= 1
