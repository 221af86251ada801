"""The balancer's client-side limits: settings validation, the connection cap against the open-file
limit, request targets and hop-by-hop headers (no network)."""

from __future__ import annotations

import resource

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from services.common import errors
from services.loadbalancer import connections, proxy
from services.loadbalancer import server as lb_server


def test_settings_refuse_limits_that_would_disable_protection() -> None:
    with pytest.raises(errors.ValidationError) as err:
        lb_server.load_settings(
            environ={},
            service_name="web",
            max_body_bytes=0,
            max_connections=0,
            retry_buffer_bytes=-1,
            header_timeout_s=0,
            body_timeout_s=-1,
            idle_timeout_s=0,
        )
    assert [v.field for v in err.value.violations] == [
        "loadbalancer.max_body_bytes",
        "loadbalancer.max_connections",
        "loadbalancer.retry_buffer_bytes",
        "loadbalancer.header_timeout_s",
        "loadbalancer.body_timeout_s",
        "loadbalancer.idle_timeout_s",
    ]


def test_settings_defaults_are_bounded() -> None:
    s = lb_server.load_settings(environ={}, service_name="web")
    assert (s.header_timeout_s, s.body_timeout_s, s.idle_timeout_s) == (10.0, 30.0, 60.0)
    assert (s.max_connections, s.retry_buffer_bytes, s.max_buffered_bytes) == (4096, 1 << 20, 64 << 20)


class Limits:
    def __init__(self, soft: int, hard: int, *, may_raise: bool = True) -> None:
        self.soft, self.hard, self.may_raise = soft, hard, may_raise

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        if not self.may_raise:
            raise ValueError("not allowed")
        self.soft, self.hard = limits


@pytest.mark.parametrize(
    ("soft", "hard", "may_raise", "cap", "soft_after"),
    [
        (1024, 1_048_576, True, 1000, 2100),  # raised to what 1000 connections need
        (1024, 1500, True, 700, 1500),  # raised to the hard limit, the cap fits it
        (1024, 1_048_576, False, 462, 1024),  # may not raise: the cap fits the soft limit
        (65536, 65536, True, 1000, 65536),  # enough already: untouched
    ],
)
def test_connection_cap_fits_the_open_file_limit(
    soft: int, hard: int, may_raise: bool, cap: int, soft_after: int
) -> None:
    limits = Limits(soft, hard, may_raise=may_raise)
    assert connections.connection_cap(1000, getrlimit=limits.get, setrlimit=limits.set) == cap
    assert limits.soft == soft_after


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("/a/b?c=%2F", ("/a/b?c=%2F", "")),
        ("//x", ("//x", "")),
        ("http://h.example/p?q", ("/p?q", "h.example")),
        ("HTTPS://H.example:8443", ("/", "H.example:8443")),
        ("http://h.example?q=1", ("/?q=1", "h.example")),
        ("http://user:pw@h.example/p", ("/p", "h.example")),
        ("*", None),
        ("h.example:443", None),
        ("ftp://h.example/f", None),
        ("", None),
    ],
)
def test_request_targets(target: str, want: tuple[str, str] | None) -> None:
    assert proxy.split_target(target) == want


def test_end_to_end_headers_drop_hop_by_hop_and_connection_named_ones() -> None:
    raw = CIMultiDict(
        [
            ("Connection", "keep-alive, X-A"),
            ("connection", " x-b ,,"),
            ("X-A", "1"),
            ("x-b", "2"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Connection", "close"),
            ("Proxy-Authorization", "Basic eDp5"),
            ("Proxy", "http://evil"),
            ("TE", "trailers"),
            ("Upgrade", "websocket"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("X-Keep", "yes"),
        ]
    )
    assert proxy.end_to_end(CIMultiDictProxy(raw)) == [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("X-Keep", "yes")]
