"""How the kubernetes backend reads, words and waits out API errors (pure parts of kube_client.py)."""

from __future__ import annotations

import json

import pytest
import tenacity

from services.provisioner import kube, kube_client, retries


def _error(status: int, reason: str = "", message: str = "m", **headers: str) -> kube_client.ApiError:
    body = json.dumps({"kind": "Status", "code": status, "reason": reason, "message": message}).encode()
    return kube_client._error(status, "HTTP-REASON", body, headers)


def test_an_error_answer_is_read_from_its_status_object_and_retry_after() -> None:
    exc = _error(429, "TooManyRequests", "slow down", **{"Retry-After": "3"})
    assert (exc.status, exc.reason, exc.message, exc.retry_after) == (429, "TooManyRequests", "slow down", 3.0)
    assert exc.transient
    plain = kube_client._error(
        502, "Bad Gateway", b"<html>proxy</html>", {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}
    )
    assert (plain.reason, plain.message, plain.retry_after) == ("Bad Gateway", "<html>proxy</html>", None)
    assert not _error(403, "Forbidden").transient and not _error(409, "Conflict").transient


@pytest.mark.parametrize(
    ("status", "reason", "tries", "text"),
    [
        (0, "", 5, "the API server could not be reached (5 tries): m"),
        (403, "Forbidden", 1, "no access (403 Forbidden): m"),
        (404, "NotFound", 1, "not found (404 NotFound): m"),
        (409, "AlreadyExists", 1, "conflict (409 AlreadyExists): m"),
        (422, "Invalid", 1, "rejected by the API server (422 Invalid): m"),
        (429, "TooManyRequests", 3, "the API server is throttling requests (429 TooManyRequests, 3 tries): m"),
        (503, "ServiceUnavailable", 3, "the API server failed (503 ServiceUnavailable, 3 tries): m"),
    ],
)
def test_failures_are_worded_with_status_reason_and_tries(status: int, reason: str, tries: int, text: str) -> None:
    exc = _error(status, reason) if status else kube_client.ApiError(0, "m")
    exc.tries = tries
    assert kube_client.describe(exc) == text


def _state(exc: BaseException, attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    state.set_exception((type(exc), exc, None))
    return state


def test_the_wait_is_the_servers_retry_after_capped_else_our_backoff() -> None:
    wait = kube_client.ServerWait(retries.wait_jittered_exponential(0.5, 2.0, 10.0, jitter=0.0))
    assert wait(_state(_error(429, "TooManyRequests", **{"Retry-After": "2"}), 1)) == 2.0
    assert wait(_state(_error(429, "TooManyRequests", **{"Retry-After": "600"}), 1)) == 10.0  # capped
    assert wait(_state(_error(503, "ServiceUnavailable"), 1)) == 0.5
    assert wait(_state(_error(503, "ServiceUnavailable"), 3)) == 2.0


async def test_a_missing_kubeconfig_stops_the_start_naming_the_file(tmp_path) -> None:
    missing = str(tmp_path / "nowhere.yaml")
    backend = kube.KubernetesBackend(kube.Options(kubeconfig=missing))
    with pytest.raises(RuntimeError) as caught:
        await backend.start()
    assert str(caught.value).startswith(f"kubernetes backend: cannot load {missing}: ")
    await backend.close()
