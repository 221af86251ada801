"""`replicactl jobs`: submit jobs to a pool, list them, show one, cancel them, follow their output."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import exits, inputs, render, tables

JOB_HEADERS = ("ID", "NAME", "STATE", "WORKER", "SUBMITTED", "DURATION", "RECOVERIES", "MESSAGE")
_ENDED = (res.JOB_STATE_SUCCEEDED, res.JOB_STATE_FAILED, res.JOB_STATE_CANCELLED)


def add_parser(command: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    """The jobs command and its actions."""
    sub = command.add_subparsers(dest="jobs_command", required=True, parser_class=parser_class, metavar="ACTION")
    submit = sub.add_parser("submit", help="queue a job on a pool; it runs on the first free READY worker")
    submit.add_argument("pool", metavar="POOL", help="the pool")
    submit.add_argument("run", nargs="+", metavar="COMMAND", help="the shell command (put it after --)")
    submit.add_argument("--name", default="", help="a name for people")
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable (repeatable)"
    )
    submit.add_argument("--logs", action="store_true", help="then follow its output until it ends")
    submit.add_argument("--json", action="store_true", help="print the job as JSON")
    for action, text in (("status", "a pool's jobs, oldest first"), ("list", "the same as status")):
        listing = sub.add_parser(action, help=text)
        listing.add_argument("pool", metavar="POOL", help="the pool")
        listing.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")
    get = sub.add_parser("get", help="one job")
    get.add_argument("pool", metavar="POOL", help="the pool")
    get.add_argument("job_id", type=int, metavar="JOB_ID", help="the job")
    get.add_argument("--json", action="store_true", help="the job as JSON")
    cancel = sub.add_parser("cancel", help="cancel jobs: queued ones at once, running ones on their worker")
    cancel.add_argument("pool", metavar="POOL", help="the pool")
    cancel.add_argument("job_ids", type=int, nargs="+", metavar="JOB_ID", help="the jobs")
    logs = sub.add_parser("logs", help="follow a job: its output until it ends (exit code: 0 if it succeeded)")
    logs.add_argument("pool", metavar="POOL", help="the pool")
    logs.add_argument("job_id", type=int, metavar="JOB_ID", help="the job")


def state(value: int) -> str:
    """SUCCEEDED for JOB_STATE_SUCCEEDED."""
    return render.watchlines.enum_label(res.JobState, value, "JOB_STATE_")


def job_row(job: res.Job, now: float) -> tuple[str, ...]:
    """One row of the jobs table."""
    submitted = render.duration(now - job.submit_time.ToSeconds()) + " ago" if job.HasField("submit_time") else "-"
    took = "-"
    if job.HasField("start_time"):
        end = job.end_time.ToSeconds() if job.HasField("end_time") else now
        took = render.duration(max(end - job.start_time.ToSeconds(), 0))
    shown = state(job.state)
    if job.state == res.JOB_STATE_FAILED and job.exit_code:
        shown += f" ({job.exit_code})"
    return (
        str(job.job_id),
        job.name or "-",
        shown,
        str(job.replica_id) if job.replica_id else "-",
        submitted,
        took,
        str(job.recoveries),
        job.message or "-",
    )


def jobs_text(jobs: Sequence[res.Job], *, tty: bool, now: float | None = None) -> str:
    """The jobs table."""
    now = time.time() if now is None else now
    return tables.table("Jobs", JOB_HEADERS, [job_row(j, now) for j in jobs], tty=tty)


def list_jobs(client: client_mod.Client, pool: str) -> list[res.Job]:
    """Every job of a pool (all pages)."""
    out: list[res.Job] = []
    token = ""
    for _ in range(100_000):
        resp = client.call("ListJobs", pb.ListJobsRequest(pool=pool, page_size=1000, page_token=token))
        out += resp.jobs
        token = resp.next_page_token
        if not token:
            break
    return out


def follow(client: client_mod.Client, pool: str, job_id: int, out: TextIO, err: TextIO) -> int:
    """Print a job's output until it ends; the exit code says how it ended."""
    last: res.Job | None = None
    for msg in client.stream("WatchJob", pb.WatchJobRequest(pool=pool, job_id=job_id)):
        if msg.output:
            out.write(msg.output.decode("utf-8", "replace"))
            out.flush()
        if msg.HasField("job"):
            if last is None or msg.job.state != last.state:
                line = f"job {job_id}: {state(msg.job.state)}"
                if msg.job.replica_id and msg.job.state == res.JOB_STATE_RUNNING:
                    line += f" on worker {msg.job.replica_id}"
                if msg.job.message:
                    line += f": {msg.job.message}"
                print(line, file=err)
            last = msg.job
    if last is None or last.state == res.JOB_STATE_SUCCEEDED:
        return exits.OK
    return exits.REFUSED  # the job failed or was cancelled, as a waited-for service that failed


def cmd_jobs(args: argparse.Namespace, client: client_mod.Client, out: TextIO, err: TextIO) -> int:
    """Run one jobs action."""
    action = args.jobs_command
    if action == "submit":
        try:
            envs, _ = inputs.overrides(envs=args.env, env_files=[], secrets=[], environ=os.environ)
        except inputs.InputError as exc:
            raise exits.CliError(f"error: {exc}", exits.BAD_INPUT) from None
        request = pb.SubmitJobRequest(pool=args.pool, run=" ".join(args.run), envs=envs, name=args.name)
        job = client.call("SubmitJob", request).job
        if args.json:
            print(render.to_json({"job": job}), file=out)
        else:
            print(f"job {job.job_id} submitted to pool {args.pool}: {state(job.state)}", file=out)
        out.flush()
        return follow(client, args.pool, job.job_id, out, err) if args.logs else exits.OK
    if action in ("list", "status"):
        jobs = list_jobs(client, args.pool)
        if args.json:
            print(render.to_json({"jobs": jobs}), file=out)
        elif jobs:
            out.write(jobs_text(jobs, tty=out.isatty()))
        else:
            print(f"No jobs in pool {args.pool}.", file=out)
        return exits.OK
    if action == "get":
        job = client.call("GetJob", pb.GetJobRequest(pool=args.pool, job_id=args.job_id)).job
        if args.json:
            print(render.to_json({"job": job}), file=out)
        else:
            out.write(jobs_text([job], tty=out.isatty()))
        return exits.OK
    if action == "cancel":
        for job_id in args.job_ids:
            job = client.call("CancelJob", pb.CancelJobRequest(pool=args.pool, job_id=job_id)).job
            word = "cancelling" if job.state == res.JOB_STATE_RUNNING else state(job.state)
            print(f"job {job_id}: {word}", file=out)
        return exits.OK
    return follow(client, args.pool, args.job_id, out, err if err is not None else sys.stderr)
