"""Unit tests of probe targets: validation, defaults, error descriptions, secrecy."""

from __future__ import annotations

import errno

import aiohttp
import pytest

from services.common import errors
from services.prober import probing

DEFAULTS = probing.Defaults(timeout_s=15, interval_s=10, fast_interval_s=0.1, min_interval_s=0.001)
SECRET = "Bearer s3cr3t-token-value"


def spec(**kwargs: object) -> probing.TargetSpec:
    values: dict[str, object] = {"target_id": "svc/1", "url": "http://127.0.0.1:8080", "path": "/health"}
    values.update(kwargs)
    return probing.TargetSpec(**values)  # type: ignore[arg-type]


def violations(target_spec: probing.TargetSpec) -> dict[str, str]:
    with pytest.raises(errors.ValidationError) as info:
        probing.make_target(target_spec, DEFAULTS)
    return {v.field: v.description for v in info.value.violations}


def test_get_target_joins_url_and_path_and_takes_defaults() -> None:
    target = probing.make_target(spec(url="http://127.0.0.1:8080/"), DEFAULTS)
    assert str(target.url) == "http://127.0.0.1:8080/health"
    assert target.method == "GET"
    assert target.body is None
    assert (target.timeout_s, target.interval_s, target.fast_interval_s) == (15, 10, 0.1)


def test_url_with_a_prefix_keeps_it() -> None:
    target = probing.make_target(spec(url="https://example.com/api"), DEFAULTS)
    assert str(target.url) == "https://example.com/api/health"


def test_empty_path_means_root() -> None:
    assert str(probing.make_target(spec(path=""), DEFAULTS).url) == "http://127.0.0.1:8080/"


def test_post_target_sends_json_with_content_type() -> None:
    target = probing.make_target(spec(method="POST", post_data_json='{"model": "x"}'), DEFAULTS)
    assert target.body == b'{"model": "x"}'
    assert dict(target.headers)["Content-Type"] == "application/json"


def test_post_keeps_a_callers_content_type() -> None:
    target = probing.make_target(
        spec(method="POST", post_data_json="{}", headers={"content-type": "application/x"}), DEFAULTS
    )
    assert dict(target.headers) == {"content-type": "application/x"}


def test_explicit_durations_win_and_tiny_intervals_are_raised() -> None:
    target = probing.make_target(spec(timeout_s=2, interval_s=0.00001, fast_interval_s=0.05), DEFAULTS)
    assert (target.timeout_s, target.interval_s, target.fast_interval_s) == (2, 0.001, 0.05)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "file:///etc/passwd", "127.0.0.1:8080", "", "javascript:x"])
def test_non_http_urls_are_refused(url: str) -> None:
    assert "url" in violations(spec(url=url))


def test_every_violation_is_reported_together() -> None:
    found = violations(spec(target_id="", url="ftp://x", path="health", method="PUT", timeout_s=-1, interval_s=-2))
    assert set(found) == {"target_id", "url", "path", "method", "timeout", "interval"}


def test_bad_json_body_is_refused() -> None:
    assert "post_data_json" in violations(spec(method="POST", post_data_json="{nope"))


def test_header_values_never_appear_in_violations() -> None:
    bad = f"{SECRET}\r\nX-Injected: 1"
    with pytest.raises(errors.ValidationError) as info:
        probing.make_target(spec(headers={"Authorization": bad}), DEFAULTS)
    assert "s3cr3t" not in info.value.message
    assert "headers[Authorization]" in info.value.message


def test_target_repr_hides_headers_and_body() -> None:
    target = probing.make_target(spec(headers={"Authorization": SECRET}, method="POST"), DEFAULTS)
    assert "s3cr3t" not in repr(target)
    assert "s3cr3t" not in repr(spec(headers={"Authorization": SECRET}))


def test_equal_specs_make_equal_targets() -> None:
    a = probing.make_target(spec(headers={"A": "1"}), DEFAULTS)
    b = probing.make_target(spec(headers={"A": "1"}), DEFAULTS)
    c = probing.make_target(spec(headers={"A": "2"}), DEFAULTS)
    assert a == b
    assert a != c


def _target() -> probing.Target:
    return probing.make_target(spec(headers={"Authorization": SECRET}, timeout_s=2.5), DEFAULTS)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError(), "timeout after 2.5s"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "connection refused"),
        (OSError(errno.EHOSTUNREACH, "no route"), "connection failed: EHOSTUNREACH"),
        (aiohttp.ServerDisconnectedError(), "server disconnected"),
        (aiohttp.ClientPayloadError("x"), "bad response body"),
        (ValueError(f"header {SECRET} is bad"), "probe error: ValueError"),
    ],
)
def test_errors_are_described_without_secrets(exc: BaseException, expected: str) -> None:
    text = probing.describe_error(exc, _target())
    assert text == expected
    assert "s3cr3t" not in text


def test_scrub_removes_header_values() -> None:
    assert probing.scrub(f"echo {SECRET}", _target()) == "echo <redacted>"


def test_result_ready_only_for_ready_outcome() -> None:
    ok = probing.Result("a", probing.Outcome.READY, 200, 0.01, "", 0.0)
    bad = probing.Result("a", probing.Outcome.REPLICA_FAILURE, 201, 0.01, "HTTP 201", 0.0)
    assert ok.ready
    assert not bad.ready


def test_a_traceparent_is_kept_and_a_malformed_one_refused() -> None:
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert probing.make_target(spec(traceparent=good), DEFAULTS).traceparent == good
    assert probing.make_target(spec(), DEFAULTS).traceparent == ""
    assert list(violations(spec(traceparent="00-xyz"))) == ["traceparent"]
