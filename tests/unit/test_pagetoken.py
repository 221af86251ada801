"""Unit tests for services.common.pagetoken: opaque page tokens bound to their listing."""

from __future__ import annotations

import base64
import json

import pytest

from services.common import errors, pagetoken


@pytest.mark.parametrize("position", ["web", "svc-12-ab12cd34", "ümlaut", 1, 2**40])
def test_a_token_round_trips_for_its_own_listing(position: str | int) -> None:
    token = pagetoken.encode("replicas", "web", position)
    assert token.isascii() and "=" not in token
    assert pagetoken.decode(token, "replicas", "web", position_type=type(position)) == position


def _refused(token: str, kind: str = "replicas", scope: str = "web", position_type: type = str) -> None:
    with pytest.raises(errors.ValidationError) as info:
        pagetoken.decode(token, kind, scope, position_type=position_type)
    assert [v.field for v in info.value.violations] == ["page_token"]


def test_made_up_truncated_and_foreign_tokens_are_refused() -> None:
    token = pagetoken.encode("replicas", "web", "web-1")
    for garbage in ("zzz", "abc", "web-1", base64.urlsafe_b64encode(b"web-1").decode(), "%%%", "é", "A" * 5000):
        _refused(garbage)
    _refused(token[:-1])
    _refused(token + "A")
    _refused(token[:5] + ("B" if token[5] != "B" else "C") + token[6:])  # one character changed
    _refused(token, scope="api")  # another filter
    _refused(token, scope="")
    _refused(token, kind="services")
    _refused(token, position_type=int)


def test_a_well_formed_token_of_another_shape_is_refused() -> None:
    def forge(value: object) -> str:
        body = json.dumps(value).encode()
        return base64.urlsafe_b64encode(pagetoken._check(body) + body).decode()

    for value in ([1, "replicas", "web"], {"a": 1}, 7, [2, "replicas", "web", "x"], [1, "replicas", "web", True]):
        _refused(forge(value), position_type=int if value == [1, "replicas", "web", True] else str)
    assert pagetoken.decode(forge([1, "replicas", "web", "x"]), "replicas", "web", position_type=str) == "x"
