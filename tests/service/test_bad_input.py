"""Bad input to the controller API: INVALID_ARGUMENT naming the field, short quotes, no change."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service.test_controller import Env, rpc_error, spec, started

PROBE = "service:\n  readiness_probe: /health\n  replicas: 1\nresources:\n  ports: 8080\n"

# (case, YAML, the field a violation must name)
BAD_SPECS = [
    ("impossible date", PROBE + "run: 2001-13-45\n", "yaml"),
    ("integer over 4300 digits", PROBE.replace("replicas: 1", "replicas: " + "9" * 5000), "yaml"),
    ("integer over 4300 digits in envs", PROBE + "envs:\n  BIG: " + "9" * 5000 + "\n", "yaml"),
    ("deeply nested post_data", PROBE.replace("/health", "{path: /, post_data: " + "[" * 400 + "]" * 400 + "}"), ""),
    (
        "post_data JSON string nested 1,000 deep",
        PROBE.replace("/health", "{path: /, post_data: '" + "[" * 1000 + "]" * 1000 + "'}"),
        "service.readiness_probe.post_data",
    ),
    (
        "post_data JSON object nested 1,000 deep",
        PROBE.replace("/health", "{path: /, post_data: '" + '{"a": ' * 1000 + "1" + "}" * 1000 + "'}"),
        "service.readiness_probe.post_data",
    ),
    (
        "post_data mapping nested 100 deep",
        PROBE.replace("/health", "{path: /, post_data: " + "{a: " * 100 + "1" + "}" * 100 + "}"),
        "service.readiness_probe.post_data",
    ),
    ("NUL byte in an env value", PROBE + 'envs:\n  A: "x\\0y"\n', "envs.A"),
    ("NUL byte in a secret", PROBE + 'secrets:\n  A: "x\\0y"\n', "secrets.A"),
    ("NUL byte in run", PROBE + 'run: "echo \\0"\n', "run"),
    ("lone surrogate escape", PROBE + 'run: "\\ud800"\n', "run"),
    (
        "a bad port in an any_of entry",
        PROBE.replace("ports: 8080", "any_of: [{ports: web}, {ports: 8080}]"),
        "resources.any_of[0].ports",
    ),
    ("replicas over the cap", PROBE.replace("replicas: 1", "replicas: 1001"), "service.replicas"),
    (
        "max_replicas over the cap",
        PROBE.replace(
            "replicas: 1", "replica_policy: {min_replicas: 1, max_replicas: 5000, target_qps_per_replica: 1}"
        ),
        "service.replica_policy.max_replicas",
    ),
]


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[Env]:
    async with started(tmp_path) as e:
        yield e


async def _nothing_created(env: Env) -> None:
    listed = await env.stub.ListServices(api.ListServicesRequest())
    assert [s.name for s in listed.services] in ([], ["keep"])


@pytest.mark.parametrize(("case", "yaml_text", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
async def test_bad_specs_are_invalid_argument_naming_the_field(env: Env, case: str, yaml_text: str, field: str) -> None:
    err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(service_name="bad", yaml=yaml_text)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code, err.message)
    fields = [f for f, _ in err.field_violations]
    assert fields, case
    if field:
        assert field in fields, (case, fields)
    await _nothing_created(env)
    await env.stub.CreateService(api.CreateServiceRequest(service_name="keep", yaml=spec("keep")))
    err = await rpc_error(env.stub.UpdateService(api.UpdateServiceRequest(service_name="keep", yaml=yaml_text)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code, err.message)
    got = await env.stub.GetService(api.GetServiceRequest(service_name="keep"))
    assert got.service.latest_version == 1


async def test_errors_quote_at_most_about_200_characters_of_input(env: Env) -> None:
    long_name = "x" * 5000
    err = await rpc_error(env.stub.GetService(api.GetServiceRequest(service_name=long_name)))
    assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert len(err.message) < 400
    for _, description in err.field_violations:
        assert len(description) < 400
    yaml_text = PROBE + "resources:\n  cpus: " + "y" * 5000 + "\n"
    err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(service_name="bad", yaml=yaml_text)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "y" * 250 not in err.message
    assert all("y" * 250 not in d for _, d in err.field_violations)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (api.ListServicesRequest(page_size=-1), "page_size"),
        (api.ListServicesRequest(page_token="garbage!"), "page_token"),
        (api.ListServicesRequest(page_token="-5"), "page_token"),
        (api.ListServicesRequest(page_token="9" * 5000), "page_token"),
        (api.ListServicesRequest(page_token="zzz"), "page_token"),
        (api.ListServicesRequest(page_token="abc"), "page_token"),
        (api.ListServicesRequest(page_token="keep"), "page_token"),
        (api.ListReplicasRequest(service_name="keep", page_size=-3), "page_size"),
        (api.ListReplicasRequest(service_name="keep", page_token="%%%"), "page_token"),
        (api.ListReplicasRequest(service_name="keep", page_token="-1"), "page_token"),
        (api.ListReplicasRequest(service_name="keep", page_token="1"), "page_token"),
        (api.ListReplicasRequest(service_name="keep", page_token="zzz"), "page_token"),
    ],
    ids=lambda v: str(v).replace("\n", " ")[:40] if not isinstance(v, str) else v,
)
async def test_bad_page_tokens_and_sizes_are_invalid_argument(env: Env, request_: object, field: str) -> None:
    await env.stub.CreateService(api.CreateServiceRequest(service_name="keep", yaml=spec("keep")))
    call = (
        env.stub.ListServices(request_)
        if isinstance(request_, api.ListServicesRequest)
        else env.stub.ListReplicas(request_)
    )
    err = await rpc_error(call)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (err.code, err.message)
    assert [f for f, _ in err.field_violations] == [field]


async def test_a_page_token_works_only_for_the_listing_that_made_it(env: Env) -> None:
    for name in ("a", "b", "c"):
        await env.stub.CreateService(api.CreateServiceRequest(service_name=name, yaml=spec(name, replicas=3)))
    names: list[str] = []
    token = ""
    for _ in range(5):
        page = await env.stub.ListServices(api.ListServicesRequest(page_size=1, page_token=token))
        names += [s.name for s in page.services]
        token = page.next_page_token
        if not token:
            break
    assert names == ["a", "b", "c"]
    services_token = (await env.stub.ListServices(api.ListServicesRequest(page_size=1))).next_page_token
    replicas_token = (
        await env.stub.ListReplicas(api.ListReplicasRequest(service_name="a", page_size=1))
    ).next_page_token
    assert services_token and replicas_token
    wrong = [
        env.stub.ListReplicas(api.ListReplicasRequest(service_name="a", page_token=services_token)),
        env.stub.ListReplicas(api.ListReplicasRequest(service_name="b", page_token=replicas_token)),
        env.stub.ListServices(api.ListServicesRequest(page_token=replicas_token)),
        env.stub.ListServices(api.ListServicesRequest(page_token=services_token[:-2])),
        env.stub.ListServices(api.ListServicesRequest(page_token=services_token + "A")),
    ]
    for call in wrong:
        err = await rpc_error(call)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (err.code, err.message)
        assert [f for f, _ in err.field_violations] == ["page_token"]


async def test_update_mode_out_of_range_is_invalid_argument(env: Env) -> None:
    await env.stub.CreateService(api.CreateServiceRequest(service_name="keep", yaml=spec("keep")))
    request = api.UpdateServiceRequest(service_name="keep", yaml=spec("keep", replicas=2))
    request.mode = 99  # type: ignore[assignment]
    err = await rpc_error(env.stub.UpdateService(request))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == ["mode"]
    got = await env.stub.GetService(api.GetServiceRequest(service_name="keep"))
    assert got.service.latest_version == 1


async def test_the_replica_cap_is_a_setting(tmp_path) -> None:
    async with started(tmp_path, max_replicas_per_service=3) as env:
        err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(service_name="bad", yaml=spec("bad", 4))))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in err.field_violations] == ["service.replicas"]
        created = await env.stub.CreateService(api.CreateServiceRequest(yaml=spec("ok", 3)))
        assert created.service.status == res.SERVICE_STATUS_REPLICA_INIT
