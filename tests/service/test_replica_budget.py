"""The controller-wide replica budget (`max_replicas_total`): what every service may run at
most, added up, stays within it; a create or update that would go over is refused whole."""

from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service.test_controller import Env, rpc_error, spec, started

AUTOSCALED = """
name: {name}
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: 1
    max_replicas: {most}
    target_qps_per_replica: 1
resources:
  ports: 8080
run: serve
"""


def quota_violations(err: grpc.aio.AioRpcError) -> list[error_details_pb2.QuotaFailure.Violation]:
    status = rpc_status.from_call(err)
    assert status is not None
    found = []
    for detail in status.details:
        if detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            quota = error_details_pb2.QuotaFailure()
            detail.Unpack(quota)
            found += list(quota.violations)
    return found


async def refused(call, field: str) -> str:  # type: ignore[no-untyped-def]
    """Awaits `call`, which must be refused for the budget naming `field`; returns the message."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        err = exc
    else:
        raise AssertionError(f"accepted, but {field} is over the replica budget")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    decoded = (await rpc_error(_raise(err))).reason
    assert decoded == "REPLICA_BUDGET_EXCEEDED"
    violations = quota_violations(err)
    assert [(v.subject, v.quota_id) for v in violations] == [(field, "max_replicas_total")]
    message = err.details() or ""
    assert field in message and "max_replicas_total" in message
    return message


async def _raise(err: grpc.aio.AioRpcError) -> None:
    raise err


async def names(env: Env) -> list[str]:
    return [s.name for s in (await env.stub.ListServices(api.ListServicesRequest())).services]


async def version(env: Env, name: str) -> int:
    return (await env.stub.GetService(api.GetServiceRequest(service_name=name))).service.latest_version


async def test_a_create_or_update_over_the_total_replica_cap_is_refused_and_changes_nothing(tmp_path) -> None:
    async with started(tmp_path, max_replicas_total=5) as env:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("a", replicas=2)))
        # An autoscaled service holds its max_replicas, whatever it runs now.
        await env.stub.CreateService(api.CreateServiceRequest(yaml=AUTOSCALED.format(name="b", most=2)))

        message = await refused(env.stub.CreateService(api.CreateServiceRequest(yaml=spec("c", 2))), "service.replicas")
        assert "4" in message and "5" in message  # in use and the limit
        assert await names(env) == ["a", "b"]
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("c", 1)))  # exactly the cap

        for dry_run in (True, False):
            await refused(
                env.stub.UpdateService(api.UpdateServiceRequest(service_name="a", yaml=spec("a", 3), dry_run=dry_run)),
                "service.replicas",
            )
        assert await version(env, "a") == 1
        await refused(
            env.stub.UpdateService(
                api.UpdateServiceRequest(service_name="b", yaml=AUTOSCALED.format(name="b", most=3))
            ),
            "service.replica_policy.max_replicas",
        )
        assert await version(env, "b") == 1

        # Shrinking one service makes room for another.
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="a", yaml=spec("a", 1)))
        await env.stub.UpdateService(
            api.UpdateServiceRequest(service_name="b", yaml=AUTOSCALED.format(name="b", most=3))
        )
        assert await version(env, "b") == 2


async def test_an_update_that_does_not_grow_a_service_passes_even_over_a_lowered_cap(tmp_path) -> None:
    state = {"state_dir": str(tmp_path / "ctl")}
    async with started(tmp_path, max_replicas_total=4, **state) as env:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("a", replicas=2)))
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("b", replicas=2)))
    # Restarted with a lower cap: the services stay; changes that do not grow them still pass.
    async with started(tmp_path, max_replicas_total=3, **state) as env:
        assert await names(env) == ["a", "b"]
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="a", yaml=spec("a", 2, run="serve2")))
        assert await version(env, "a") == 2
        await refused(
            env.stub.UpdateService(api.UpdateServiceRequest(service_name="a", yaml=spec("a", 3))), "service.replicas"
        )


async def test_replicas_of_a_service_being_deleted_count_until_they_are_gone(tmp_path) -> None:
    async with started(tmp_path, max_replicas_total=2) as env:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("old", replicas=2)))
        for _ in range(200):
            replicas = (await env.stub.ListReplicas(api.ListReplicasRequest(service_name="old"))).replicas
            if len(replicas) == 2 and all(r.replica_name in env.provisioner.running for r in replicas):
                break
            await asyncio.sleep(0.05)
        env.provisioner.fail_teardown.update(r.replica_name for r in replicas)
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="old"))
        for _ in range(200):
            svc = (await env.stub.GetService(api.GetServiceRequest(service_name="old"))).service
            if svc.status == res.SERVICE_STATUS_FAILED_CLEANUP:
                break
            await asyncio.sleep(0.05)
        assert svc.status == res.SERVICE_STATUS_FAILED_CLEANUP
        # Its two replicas may still run: no room for a new one.
        await refused(env.stub.CreateService(api.CreateServiceRequest(yaml=spec("new", 1))), "service.replicas")
        env.provisioner.fail_teardown.clear()
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="old", purge=True))
        for _ in range(200):
            if await names(env) == []:
                break
            await asyncio.sleep(0.05)
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("new", 2)))


async def test_creates_and_updates_checked_at_the_same_time_never_take_more_than_the_cap_together(tmp_path) -> None:
    # Each call is checked, then stored: one checked while another was being stored must count it.
    async with started(tmp_path, max_replicas_total=10) as env:
        creates = [env.stub.CreateService(api.CreateServiceRequest(yaml=spec(f"s{i}", replicas=3))) for i in range(8)]
        created = await asyncio.gather(*creates, return_exceptions=True)
        assert sum(not isinstance(c, BaseException) for c in created) == 3
        for outcome in created:
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, grpc.aio.AioRpcError)
                assert outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        taken = await names(env)
        assert len(taken) == 3
        # 9 of 10 held: two services growing by one each at the same time, only one fits.
        grown = await asyncio.gather(
            *(env.stub.UpdateService(api.UpdateServiceRequest(service_name=n, yaml=spec(n, 4))) for n in taken[:2]),
            return_exceptions=True,
        )
        assert sum(not isinstance(g, BaseException) for g in grown) == 1
        assert sorted([await version(env, n) for n in taken[:2]]) == [1, 2]
