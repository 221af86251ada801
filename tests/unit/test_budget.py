"""The replica budget's sum kept in step (`budget.Budget`): after any changes it equals the sum
counted from scratch, and reservations of calls being stored count against other calls."""

from __future__ import annotations

import dataclasses
import random

import pytest

from replicaplane.common.v1 import spec_pb2
from services.common import errors, spec
from services.controller import budget


@dataclasses.dataclass
class Held:
    most: int
    records: int = 0

    def most_replicas(self) -> int:
        return self.most

    def reserved_replicas(self) -> int:
        return max(self.most, self.records)


def _spec(replicas: int) -> spec_pb2.ServiceSpec:
    text = f"name: x\nservice:\n  readiness_probe: /\n  replicas: {replicas}\nresources:\n  ports: 8080\nrun: x\n"
    return spec.parse(text, name="x")


def test_the_sum_follows_every_change_it_is_told_of() -> None:
    rng = random.Random(7)
    services: dict[str, Held] = {}
    b = budget.Budget(services, limit=10_000)
    for _ in range(2000):
        name = f"s{rng.randrange(30)}"
        if name in services and rng.random() < 0.1:
            del services[name]
        elif name in services:
            services[name].records = rng.randrange(20)
            services[name].most = rng.randrange(1, 15)
        else:
            services[name] = Held(rng.randrange(1, 15))
        b.touched(name)
        if rng.random() < 0.3:
            assert b.held() == sum(s.reserved_replicas() for s in services.values())
    assert b.held() == sum(s.reserved_replicas() for s in services.values())


def test_a_reservation_counts_against_other_calls_until_its_block_ends() -> None:
    services = {"a": Held(4)}
    b = budget.Budget(services, limit=10)
    b.touched("a")
    with b.reserve("b", _spec(5)):  # 4 + 5 of 10
        with pytest.raises(errors.ResourceExhaustedError), b.reserve("c", _spec(2)):
            pass
        with b.reserve("c", _spec(1)):  # exactly the limit
            pass
    with b.reserve("c", _spec(6)):  # b's reservation ended with its block
        pass
