"""Log redaction: no probe header value or token survives in a log line."""

from __future__ import annotations

import logging
import sys

import pytest

from services.common import errors, logs

SECRETS = ["s3cr3t-value", "eyJhbGciOi.payload.sig", "hunter2", "k-123456"]


@pytest.fixture
def root_logging():
    """Restore the root logger after a test that calls logs.setup()."""
    root = logging.getLogger()
    handlers, level, hook = root.handlers[:], root.level, sys.excepthook
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook = hook


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer s3cr3t-value",
        "authorization=Bearer eyJhbGciOi.payload.sig",
        "{'Authorization': 'Bearer hunter2'}",
        '{"Proxy-Authorization": "Basic hunter2"}',
        "x-api-key: k-123456",
        "api_key=k-123456 and more",
        "token=s3cr3t-value",
        "password: hunter2",
        "Cookie: session=s3cr3t-value",
        "secret='hunter2'",
    ],
)
def test_redact_text_hides_credential_values(text: str) -> None:
    cleaned = logs.redact_text(text)
    assert logs.REDACTED in cleaned
    assert not any(secret in cleaned for secret in SECRETS)


def test_redact_text_keeps_ordinary_text() -> None:
    text = "replica 3 READY at http://127.0.0.1:41234 after 2 probes"
    assert logs.redact_text(text) == text


def test_redact_headers_hides_every_value_and_keeps_names() -> None:
    headers = {"Authorization": "Bearer s3cr3t-value", "X-Custom": "hunter2"}
    assert logs.redact_headers(headers) == {"Authorization": logs.REDACTED, "X-Custom": logs.REDACTED}


def test_setup_redacts_formatted_messages_and_their_arguments(root_logging, capsys) -> None:
    logs.setup("prober", level="DEBUG")
    log = logging.getLogger("services.prober.test")
    log.info("probing with headers %s", {"Authorization": "Bearer s3cr3t-value"})
    log.warning("probe failed: authorization=Bearer eyJhbGciOi.payload.sig")
    log.debug("headers %s", logs.redact_headers({"X-Custom": "hunter2"}))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 3
    assert "prober INFO services.prober.test: probing with headers" in err
    assert not any(secret in err for secret in SECRETS)


def test_setup_level_comes_from_the_environment(root_logging, monkeypatch) -> None:
    monkeypatch.setenv("REPLICAPLANE_LOG_LEVEL", "warning")
    logs.setup("controller")
    assert root_logging.level == logging.WARNING


def test_setup_redacts_secrets_in_tracebacks(root_logging, capsys) -> None:
    logs.setup("controller")
    try:
        raise RuntimeError("probe of http://x failed with Authorization: Bearer s3cr3t-value")
    except RuntimeError:
        logging.getLogger("services.controller.test").exception("probe failed")
    assert "s3cr3t-value" not in capsys.readouterr().err


def test_an_unknown_level_names_the_setting(root_logging, monkeypatch) -> None:
    monkeypatch.setenv("REPLICAPLANE_LOG_LEVEL", "loud")
    with pytest.raises(
        errors.StartupError, match=r"^REPLICAPLANE_LOG_LEVEL: unknown log level 'loud'; use one of DEBUG"
    ):
        logs.setup("controller")
    assert logs.check_level(" warn ") == "WARN"


def test_a_setting_that_stops_a_service_is_one_line_without_traceback(root_logging, capsys) -> None:
    logs.setup("controller")
    bad = errors.ValidationError([errors.FieldViolation("controller.x", "expected int, got 'y'")], subject="settings")
    sys.excepthook(type(bad), bad, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].endswith("cannot start: invalid settings: controller.x: expected int, got 'y'")
    assert " controller CRITICAL " in err[0]


def test_an_unexpected_error_keeps_its_traceback_redacted(root_logging, capsys) -> None:
    logs.setup("controller")
    try:
        raise KeyError("token=s3cr3t-value")
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert "stopped by an unexpected error" in err and "Traceback" in err
    assert "s3cr3t-value" not in err
