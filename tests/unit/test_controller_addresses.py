"""Clients given several controller addresses (controllers sharing a store, one leading)."""

from __future__ import annotations

import pytest

from services.common import clients


def test_one_address_is_used_as_it_is() -> None:
    for addr in ("127.0.0.1:50051", "controller:50051", "dns:///controllers:50051", "unix:/run/c.sock"):
        assert clients.controller_target(addr) == addr


def test_several_become_one_target_tried_in_order() -> None:
    assert clients.controller_target("127.0.0.1:1, 127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert clients.controller_target("localhost:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert clients.controller_target("[::1]:1,127.0.0.1:2") == "ipv6:[::1]:1,[::ffff:127.0.0.1]:2"


@pytest.mark.parametrize("addrs", ["127.0.0.1:1,unix:/x.sock", "127.0.0.1:1,nohost", "a:1,no-such-host.invalid:2"])
def test_a_list_with_something_else_is_refused(addrs: str) -> None:
    with pytest.raises(ValueError):
        clients.controller_target(addrs)
