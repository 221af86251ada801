"""docs/grpcurl.md, run command by command against a live stack."""

from __future__ import annotations

import base64
import json
import os
import re

import pytest

from tests.e2e.test_readme_grpcurl import guarded, run, watch_until_ready
from tests.helpers import cluster as cl
from tests.helpers import procs, provisioner_procs

pytestmark = pytest.mark.e2e

SERVICE = "replicaplane.controller.v1.ControllerService"


def cookbook_commands() -> list[str]:
    with open(os.path.join(procs.REPO, "docs", "grpcurl.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = re.search(r"<!-- cookbook:start -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/grpcurl.md lost its cookbook block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


__all__ = ["guarded"]  # the fixture: a controller that requires a token, as under `make up`


async def test_grpcurl_cookbook_commands_work_in_order(guarded: tuple[cl.Cluster, str]) -> None:
    cluster, token_file = guarded
    addr = cluster.controller.addr
    seen: list[str] = []
    reports: list[dict[str, object]] = []
    for command in cookbook_commands():
        target = command.split()[-1]
        if "/" in target:
            method = target.rsplit("/", 1)[-1]
        else:
            method = "list" if target == "list" else "describe"
        seen.append(method)
        if method == "WatchService":
            watched = watch_until_ready(command, addr, token_file)  # returns once 2 replicas are READY
            assert '"snapshot": true' in watched
            continue
        out = run(command, addr, token_file)
        if method == "list":
            assert SERVICE in out and "grpc.health.v1.Health" in out
        elif method == "describe":
            assert "rpc CreateService" in out or "message Service" in out
        elif method == "Check":
            assert json.loads(out)["status"] == "SERVING"
        elif method == "CreateService":
            assert json.loads(out)["service"]["name"] in ("cookbook", "jobs")
        elif method == "GetService":
            assert json.loads(out)["service"]["ready_replicas"] == 2
        elif method == "ListReplicas":
            assert [r["status"] for r in json.loads(out)["replicas"]] == ["REPLICA_STATUS_READY"] * 2
        elif method == "StreamReplicaLogs":
            decoder, text, rest = json.JSONDecoder(), b"", out.strip()
            while rest:
                msg, end = decoder.raw_decode(rest)
                text += base64.b64decode(msg.get("data", ""))
                rest = rest[end:].strip()
            assert b"GET / HTTP/1.1" in text  # the probes, as http.server logs them
        elif method == "UpdateService":
            assert json.loads(out)["plan"]["in_place"] is True
        elif method == "ReportLoad":
            reports.append(json.loads(out))
        elif method in ("ListOrphans", "ReapOrphans"):
            answer = json.loads(out)
            assert answer["controller_id"] and not answer.get("orphans") and not answer.get("reaped")
        elif method == "SubmitJob":
            assert json.loads(out)["job"]["job_id"] == "1"
        elif method == "WatchJob":
            decoder, text, rest, states = json.JSONDecoder(), b"", out.strip(), []
            while rest:
                msg, end = decoder.raw_decode(rest)
                text += base64.b64decode(msg.get("output", ""))
                states += [msg["job"]["state"]] if "job" in msg else []
                rest = rest[end:].strip()
            assert text.startswith(b"hello from jobs-") and states[-1] == "JOB_STATE_SUCCEEDED"
        elif method in ("GetJob", "CancelJob"):
            assert json.loads(out)["job"]["state"] == "JOB_STATE_SUCCEEDED"
        elif method == "ListJobs":
            assert [j["state"] for j in json.loads(out)["jobs"]] == ["JOB_STATE_SUCCEEDED"]
        elif method == "ListServices":
            assert [s["name"] for s in json.loads(out)["services"]] == ["cookbook"]
        elif method == "DeleteService":
            assert json.loads(out)["service"]["status"] == "SERVICE_STATUS_SHUTTING_DOWN"
    assert "CreateService" in seen and "WatchService" in seen and "Check" in seen and "describe" in seen
    assert "ListOrphans" in seen and "ReapOrphans" in seen
    assert {"SubmitJob", "WatchJob", "ListJobs", "GetJob", "CancelJob"} <= set(seen)
    # The same report twice: counted once (int64 prints as a string; false and 0 are left out).
    assert [(r.get("counted_requests"), r.get("already_applied", False)) for r in reports] == [
        ("2", False),
        (None, True),
    ]
    assert provisioner_procs.wait_no_replicas(cluster.provisioner_state_dir, timeout=15) == []
