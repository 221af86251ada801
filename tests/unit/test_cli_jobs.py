"""What replicactl prints for pools and jobs: the KIND column, who uses a worker, the jobs table."""

from __future__ import annotations

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import jobs, main, render

NOW = 1_700_000_000.0


def _svc(name: str, *, pool: bool) -> res.Service:
    svc = res.Service(name=name, status=res.SERVICE_STATUS_READY, ready_replicas=1, total_replicas=2)
    if pool:
        svc.kind = spec_pb2.FLEET_KIND_POOL
        svc.queued_jobs, svc.running_jobs = 4, 1
    return svc


def test_status_shows_kind_only_when_a_pool_is_listed_and_workers_show_their_job() -> None:
    plain = render.status_text([_svc("web", pool=False)], [], tty=False, now=NOW)
    assert "KIND" not in plain
    workers = [
        res.Replica(service="batch", replica_id=1, status=res.REPLICA_STATUS_READY, job_id=7),
        res.Replica(service="batch", replica_id=2, status=res.REPLICA_STATUS_READY),
        res.Replica(service="batch", replica_id=3, status=res.REPLICA_STATUS_STARTING),
    ]
    text = render.status_text([_svc("web", pool=False), _svc("batch", pool=True)], workers, tty=False, now=NOW)
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["NAME", "KIND"]
    assert lines[2].split()[:2] == ["web", "SERVICE"] and lines[3].split()[:2] == ["batch", "POOL"]
    assert "batch: pool, 4 job(s) queued, 1 running" in text
    start = next(i for i, line in enumerate(lines) if line.startswith("SERVICE "))
    rows = [line.split() for line in lines[start + 1 :] if line.startswith("batch ")]
    assert [r[3:5] if r[3] == "job" else r[3:4] for r in rows] == [["job", "7"], ["idle"], ["-"]]


def test_the_jobs_table() -> None:
    job = res.Job(
        job_id=3, name="train", state=res.JOB_STATE_FAILED, replica_id=2, exit_code=4, recoveries=1, message="boom"
    )
    job.submit_time.FromSeconds(int(NOW) - 90)
    job.start_time.FromSeconds(int(NOW) - 60)
    job.end_time.FromSeconds(int(NOW) - 30)
    text = jobs.jobs_text([job, res.Job(job_id=4, state=res.JOB_STATE_PENDING)], tty=False, now=NOW)
    lines = text.splitlines()
    assert lines[1].split() == list(jobs.JOB_HEADERS)
    assert lines[2].split()[:4] == ["3", "train", "FAILED", "(4)"]
    assert lines[2].split()[-2:] == ["1", "boom"]
    assert lines[3].split() == ["4", "-", "PENDING", "-", "-", "-", "0", "-"]


def test_jobs_commands_parse() -> None:
    args = main.parser().parse_args(["jobs", "submit", "batch", "--env", "A=1", "--", "python", "train.py", "-x"])
    assert (args.pool, args.run, args.env) == ("batch", ["python", "train.py", "-x"], ["A=1"])
    assert main.parser().parse_args(["jobs", "cancel", "batch", "1", "2"]).job_ids == [1, 2]
    assert main.parser().parse_args(["jobs", "status", "batch"]).jobs_command == "status"


def test_up_wait_is_done_for_a_pool_once_its_wanted_workers_are_ready() -> None:
    from services.cli import client

    empty = _svc("batch", pool=True)
    empty.status, empty.ready_replicas, empty.target_replicas = res.SERVICE_STATUS_NO_REPLICA, 0, 0
    assert client.all_ready(empty)
    empty.status = res.SERVICE_STATUS_CONTROLLER_INIT
    assert not client.all_ready(empty)
    two = _svc("batch", pool=True)
    two.status, two.ready_replicas, two.target_replicas = res.SERVICE_STATUS_REPLICA_INIT, 1, 2
    assert not client.all_ready(two)
