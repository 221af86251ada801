"""Property-based fuzzing of the controller's API: hypothesis strategies for task YAML and for
every request type, a controller (scripted provisioner, real prober) served from a thread, and
the check every call must pass: a clean gRPC status, field violations with INVALID_ARGUMENT,
and no state change when the call failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any

import grpc
import yaml
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_status import rpc_status
from hypothesis import strategies as st

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import server as controller_server
from services.prober import server as prober_server
from tests.helpers import fake_provisioner

# Codes a call may end with on bad input; anything else (INTERNAL, UNKNOWN) is a crash.
CLEAN_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
BASE = "base"
# Probe header value planted in every base spec: no answer or error may show it.
SECRET = "fuzz-secret"
BASE_YAML = """\
name: base
service:
  readiness_probe:
    path: /health
    headers: {X-Api-Key: fuzz-secret}
  replicas: 1
resources:
  ports: 8080
run: serve
"""

# ---- strategies --------------------------------------------------------------------------

# Text that protobuf can carry (no lone surrogates), with control characters and NULs.
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
names = st.one_of(st.just(BASE), st.just(""), st.from_regex(r"[a-z][-a-z0-9]{0,70}", fullmatch=True), texts)
ints = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 10**6]),
)
int32s = st.integers(-(2**31), 2**31 - 1)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    # Past Python's 4300-digit str() limit; drawn as a small offset so hypothesis can print it.
    st.integers(0, 100).map(lambda k: 10**4300 + k),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
    st.sampled_from(["/health", "least_load", "dynamic_fallback", "8080", "2+", "2024-01-01", "{}", "[]", "yes"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)

KEYS = {
    "service": [
        "readiness_probe",
        "replicas",
        "replica_policy",
        "load_balancing_policy",
        "ports",
    ],
    "service.readiness_probe": [
        "path",
        "initial_delay_seconds",
        "timeout_seconds",
        "post_data",
        "headers",
        "consecutive_failure_threshold_timeout",
        "endpoint_probe_interval_seconds",
    ],
    "service.replica_policy": [
        "min_replicas",
        "max_replicas",
        "target_qps_per_replica",
        "upscale_delay_seconds",
        "downscale_delay_seconds",
        "num_overprovision",
        "base_ondemand_fallback_replicas",
        "dynamic_ondemand_fallback",
        "spot_placer",
    ],
    "resources": ["ports", "use_spot", "cpus", "any_of", "accelerators"],
    "": ["name", "service", "resources", "envs", "setup", "run", "workdir", "file_mounts"],
}


def _base_doc() -> dict[str, Any]:
    return {
        "name": "fuzzed",
        "service": {
            "readiness_probe": {"path": "/health", "headers": {"Authorization": "Bearer fuzz-secret"}},
            "replica_policy": {"min_replicas": 1, "max_replicas": 3, "target_qps_per_replica": 2},
        },
        "resources": {"ports": 8080},
        "run": "serve",
    }


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    """A valid spec with a few keys replaced, added or removed."""
    doc = _base_doc()
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(KEYS)))
        key = draw(st.one_of(st.sampled_from(KEYS[section]), texts))
        target: Any = doc
        for part in [p for p in section.split(".") if p]:
            if not isinstance(target, dict):
                break
            target = target.setdefault(part, {})
        if not isinstance(target, dict):
            continue
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(values)
    return doc


def _deep(depth: int) -> str:
    return "service:\n  replicas: " + "[" * depth + "]" * depth + "\n"


def _dump(doc: Any, style: str) -> str:
    try:
        if style == "json":
            return json.dumps(doc, default=str)
        return yaml.safe_dump(doc, allow_unicode=True)
    except (yaml.YAMLError, ValueError, RecursionError):
        return "service: {replicas: " + "9" * 5000 + "}\n"  # an int too long to print


yaml_texts = st.one_of(
    st.builds(_dump, mutated_docs(), st.sampled_from(["yaml", "json"])),
    st.builds(_dump, values, st.just("yaml")),
    texts,
    st.builds(_deep, st.integers(10, 5000)),
    st.sampled_from(
        [
            "",
            "\x00",
            "name: a\nservice: {replicas: 1}\nrun: x\nresources: {ports: 8080}\ncreated: 2024-01-01\n",
            "&a [*a]",
            "a: &a\n  b: *a\n",
            "!!python/object:os.system {}\n",
            "service: {replicas: " + "9" * 5000 + "}\n",
            "- - - - -\n",
        ]
    ),
)


def _stamp(seconds: int, nanos: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


stamps = st.builds(_stamp, ints, st.integers(-(2**31), 2**31 - 1))


def _age(seconds: int, nanos: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


ages = st.builds(_age, ints, st.integers(-(2**31), 2**31 - 1))

version_stats = st.builds(
    lambda v, r, e, t, b, s: res.VersionStats(
        version=v, requests=r, server_errors=e, transport_errors=t, latency_buckets=b, latency_sum=s
    ),
    ints,
    ints,
    ints,
    ints,
    st.dictionaries(st.integers(-(2**31), 2**31 - 1), ints, max_size=4),
    ages,
)

requests = st.one_of(
    st.builds(
        lambda n, y, r: ("CreateService", api.CreateServiceRequest(service_name=n, yaml=y, request_id=r)),
        names,
        yaml_texts,
        texts,
    ),
    st.builds(lambda n: ("GetService", api.GetServiceRequest(service_name=n)), names),
    st.builds(lambda s, t: ("ListServices", api.ListServicesRequest(page_size=s, page_token=t)), int32s, texts),
    st.builds(
        lambda n, y, m, d, r: (
            "UpdateService",
            api.UpdateServiceRequest(service_name=n, yaml=y, mode=m, dry_run=d, request_id=r),
        ),
        names,
        yaml_texts,
        int32s,
        st.booleans(),
        texts,
    ),
    st.builds(lambda n, p: ("DeleteService", api.DeleteServiceRequest(service_name=n, purge=p)), names, st.booleans()),
    st.builds(
        lambda n, s, t: ("ListReplicas", api.ListReplicasRequest(service_name=n, page_size=s, page_token=t)),
        names,
        int32s,
        texts,
    ),
    st.builds(lambda n, i: ("GetReplica", api.GetReplicaRequest(service_name=n, replica_id=i)), names, ints),
    st.builds(
        lambda n, i, p: ("TerminateReplica", api.TerminateReplicaRequest(service_name=n, replica_id=i, purge=p)),
        names,
        ints,
        st.booleans(),
    ),
    st.builds(lambda n: ("PurgeReplicas", api.PurgeReplicasRequest(service_name=n)), names),
    st.builds(lambda n, s: ("WatchService", api.WatchServiceRequest(service_name=n, after_sequence=s)), names, ints),
    st.builds(
        lambda n, ts, c: ("ReportLoad", api.ReportLoadRequest(service_name=n, request_times=ts, request_count=c)),
        names,
        st.lists(stamps, max_size=5),
        ints,
    ),
    st.builds(
        lambda n, a, b, q: (
            "ReportLoad",
            api.ReportLoadRequest(service_name=n, request_ages=a, balancer_id=b, sequence=q),
        ),
        names,
        st.lists(ages, max_size=5),
        texts,
        ints,
    ),
    st.builds(
        lambda n, c, v: ("ReportLoad", api.ReportLoadRequest(service_name=n, request_count=c, version_stats=v)),
        names,
        ints,
        st.lists(version_stats, max_size=4),
    ),
    st.builds(lambda n, v: ("WatchEndpoints", api.WatchEndpointsRequest(service_name=n, after_version=v)), names, ints),
    st.builds(
        lambda o, s, t: ("ListOrphans", api.ListOrphansRequest(owner=o, page_size=s, page_token=t)),
        texts,
        int32s,
        texts,
    ),
    st.builds(
        lambda n, o, a: ("ReapOrphans", api.ReapOrphansRequest(replica_names=n, owner=o, all_owners=a)),
        st.lists(names, max_size=5),
        texts,
        st.booleans(),
    ),
    st.builds(
        lambda p, r, e, n: ("SubmitJob", api.SubmitJobRequest(pool=p, run=r, envs=e, name=n)),
        names,
        texts,
        st.dictionaries(texts, texts, max_size=3),
        texts,
    ),
    st.builds(lambda p, i: ("GetJob", api.GetJobRequest(pool=p, job_id=i)), names, ints),
    st.builds(
        lambda p, s, t: ("ListJobs", api.ListJobsRequest(pool=p, page_size=s, page_token=t)), names, int32s, texts
    ),
    st.builds(lambda p, i: ("CancelJob", api.CancelJobRequest(pool=p, job_id=i)), names, ints),
    st.builds(
        lambda p, i, o: ("WatchJob", api.WatchJobRequest(pool=p, job_id=i, states_only=o)), names, ints, st.booleans()
    ),
    st.builds(
        lambda n, s, t: ("ListEvents", api.ListEventsRequest(service_name=n, page_size=s, page_token=t)),
        names,
        int32s,
        texts,
    ),
    st.builds(lambda n, s: ("WatchEvents", api.WatchEventsRequest(service_name=n, after_sequence=s)), names, ints),
    st.builds(lambda n: ("ListVersions", api.ListVersionsRequest(service_name=n)), names),
    st.builds(
        lambda n, v, d: ("RollbackService", api.RollbackServiceRequest(service_name=n, to_version=v, dry_run=d)),
        names,
        ints,
        st.booleans(),
    ),
    st.builds(lambda n, f: ("PromoteRollout", api.PromoteRolloutRequest(service_name=n, full=f)), names, st.booleans()),
    st.builds(lambda n: ("AbortRollout", api.AbortRolloutRequest(service_name=n)), names),
)

MUTATIONS = {
    "CreateService",
    "UpdateService",
    "DeleteService",
    "TerminateReplica",
    "PurgeReplicas",
    "ReapOrphans",
    "SubmitJob",
    "CancelJob",
    "RollbackService",
    "PromoteRollout",
    "AbortRollout",
}

# ---- the controller under fuzz -----------------------------------------------------------


class ControllerThread:
    """A controller with a scripted provisioner and a real prober, on an event loop in a thread,
    so that synchronous hypothesis tests can call it."""

    def __init__(self, state_dir: str) -> None:
        self.addr = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(state_dir,), daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"controller did not start: {self._error!r}")

    def _run(self, state_dir: str) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(state_dir))

    async def _serve(self, state_dir: str) -> None:
        self._stop = asyncio.Event()
        try:
            async with fake_provisioner.serving() as (_fake, provisioner_addr):
                prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
                await prober.start()
                settings = controller_server.Settings(
                    listen_addr="127.0.0.1:0",
                    state_dir=os.path.join(state_dir, "ctl"),
                    provisioner_addr=provisioner_addr,
                    prober_addrs=f"127.0.0.1:{prober.port}",
                    drain_s=0.05,
                )
                running = await controller_server.start(settings)
                self.addr = f"127.0.0.1:{running.port}"
                self._ready.set()
                await self._stop.wait()
                await running.stop(None)
                await prober.stop(None)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def close(self) -> None:
        """Stop the servers and the thread."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


# ---- the property ------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """Counts over a fuzz session."""

    cases: int = 0
    crashes: list[str] = dataclasses.field(default_factory=list)
    codes: dict[str, int] = dataclasses.field(default_factory=dict)


def snapshot(stub: api_grpc.ControllerServiceStub) -> list[tuple[str, int, bytes]]:
    """Every service's name, latest version and spec: what a failed call must not change."""
    out = []
    token = ""
    for _ in range(100):
        reply = stub.ListServices(api.ListServicesRequest(page_size=1000, page_token=token), timeout=30)
        out += [(s.name, s.latest_version, s.spec.SerializeToString(deterministic=True)) for s in reply.services]
        token = reply.next_page_token
        if not token:
            break
    return sorted(out)


def _call(stub: api_grpc.ControllerServiceStub, method: str, request: Any) -> Any:
    fn = getattr(stub, method)
    if method.startswith("Watch"):
        call = fn(request, timeout=2)
        try:
            return next(iter(call))
        except StopIteration:
            return None
        finally:
            call.cancel()
    return fn(request, timeout=30)


def _has_violations(err: grpc.RpcError) -> bool:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return False
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bool(bad.field_violations) and all(v.field for v in bad.field_violations)
    return False


def check(stub: api_grpc.ControllerServiceStub, method: str, request: Any, outcome: Outcome) -> str | None:
    """Make one call and judge it; returns a crash description, or None when the call was clean.

    A successful create or delete is undone, so state does not pile up across cases.
    """
    outcome.cases += 1
    before = snapshot(stub) if method in MUTATIONS else None
    try:
        reply = _call(stub, method, request)
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        outcome.codes[code.name] = outcome.codes.get(code.name, 0) + 1
        said = f"{err.details()} {err.trailing_metadata()}"  # type: ignore[attr-defined]
        if SECRET in said:
            return f"{method}: {code.name} error shows a probe header secret"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and method.startswith("Watch"):
            return None  # a watch with nothing to say yet
        if code not in CLEAN_CODES:
            return f"{method}: {code.name}: {err.details()}"  # type: ignore[attr-defined]
        if code == grpc.StatusCode.INVALID_ARGUMENT and not _has_violations(err):
            return f"{method}: INVALID_ARGUMENT without field violations: {err.details()}"  # type: ignore[attr-defined]
        if before is not None and snapshot(stub) != before:
            return f"{method}: failed with {code.name} but changed state"
        return None
    outcome.codes["OK"] = outcome.codes.get("OK", 0) + 1
    if SECRET in str(reply):
        return f"{method}: the answer shows a probe header secret"
    if method == "CreateService" and reply is not None and reply.service.name != BASE:
        with contextlib.suppress(grpc.RpcError):
            stub.DeleteService(api.DeleteServiceRequest(service_name=reply.service.name, purge=True), timeout=30)
        wait_gone(stub, reply.service.name)
    if method == "DeleteService" and getattr(request, "service_name", "") == BASE:
        wait_gone(stub, BASE)
        ensure_base(stub)
    return None


def wait_gone(stub: api_grpc.ControllerServiceStub, name: str, timeout: float = 30.0) -> None:
    """Wait until a deleted service is NOT_FOUND, so the next case starts from settled state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stub.GetService(api.GetServiceRequest(service_name=name), timeout=30)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                return
        time.sleep(0.02)


def ensure_base(stub: api_grpc.ControllerServiceStub) -> None:
    """(Re)create the service most generated names point at, waiting out a delete in flight."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            stub.CreateService(api.CreateServiceRequest(yaml=BASE_YAML), timeout=30)
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:  # type: ignore[attr-defined]
                raise
            try:
                svc = stub.GetService(api.GetServiceRequest(service_name=BASE), timeout=30).service
            except grpc.RpcError:
                continue
            if svc.status != res.SERVICE_STATUS_SHUTTING_DOWN:  # it is there
                return
            time.sleep(0.1)


def run_session(state_dir: str, strategy: Any, max_examples: int, *, raise_on_crash: bool) -> Outcome:
    """Drive `strategy` (of (method, request) pairs) through `check` with hypothesis."""
    from hypothesis import HealthCheck, given, settings

    outcome = Outcome()
    server = ControllerThread(state_dir)
    channel = grpc.insecure_channel(server.addr, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    stub = api_grpc.ControllerServiceStub(channel)
    try:
        ensure_base(stub)

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def prop(case: tuple[str, Any]) -> None:
            crash = check(stub, case[0], case[1], outcome)
            if crash is not None:
                outcome.crashes.append(crash)
                if raise_on_crash:
                    raise AssertionError(crash)

        prop()
        # Oversized messages: refused cleanly, nothing stored.
        for size in (17 * 1024 * 1024,):
            big = api.CreateServiceRequest(yaml="run: " + "x" * size)
            crash = check(stub, "CreateService", big, outcome)
            if crash is not None:
                outcome.crashes.append(crash)
    finally:
        channel.close()
        server.close()
    return outcome


spec_requests = st.one_of(
    st.builds(lambda y: ("CreateService", api.CreateServiceRequest(yaml=y)), yaml_texts),
    st.builds(lambda y: ("UpdateService", api.UpdateServiceRequest(service_name=BASE, yaml=y)), yaml_texts),
    st.builds(
        lambda y: ("UpdateService", api.UpdateServiceRequest(service_name=BASE, yaml=y, dry_run=True)), yaml_texts
    ),
)
