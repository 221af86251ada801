"""Whose fault a launch failure was decides what it does to the version (issue 19): the user's
stops a version that was never ready; the infrastructure's pauses launches and is retried."""

from __future__ import annotations

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from tests.service.test_controller import Env, create, spec
from tests.service.test_controller import env as env  # the fixture

READY = res.REPLICA_STATUS_READY
USER = prov_res.FAILURE_CAUSE_USER
INFRA = prov_res.FAILURE_CAUSE_INFRASTRUCTURE


async def test_a_transient_503_is_retried_after_a_pause_and_never_stops_the_version(env: Env) -> None:
    env.provisioner.failing_launches.append(("the API server answered HTTP 503", INFRA))
    w = await create(env, spec())
    # The failure pauses launches and the service says so; the version is not stopped.
    await w.until(lambda w: "launches paused" in w.service.status_message, timeout=10)
    assert "scaling stopped" not in w.service.status_message
    assert "HTTP 503" in w.service.status_message
    # After the pause (1 s) the next launch runs and the service becomes READY.
    await w.until(lambda w: w.count(READY) == 1 and w.service.status == res.SERVICE_STATUS_READY, timeout=20)
    failed = [r for r in w.replicas.values() if r.status == res.REPLICA_STATUS_FAILED_PROVISION]
    assert len(failed) == 1 and "HTTP 503" in failed[0].failure_reason
    w.cancel()


async def test_a_broken_setup_still_stops_the_version(env: Env) -> None:
    env.provisioner.failing_launches.append(("setup exited with code 1", USER))
    w = await create(env, spec())
    await w.until(lambda w: "scaling stopped" in w.service.status_message, timeout=10)
    assert "setup exited with code 1" in w.service.status_message
    await w.until(lambda w: w.service.status == res.SERVICE_STATUS_NO_REPLICA, timeout=10)
    assert sum(env.provisioner.launches.values()) == 1  # nothing relaunched
    w.cancel()
