"""Failover benchmark: how long the API has no leader when the leading controller dies.

Two controller processes share a throwaway PostgreSQL store (tests/helpers/postgres.py) with the
default 3 s lease, under light churn; each round kills the leader with SIGKILL and measures the
time until the standby leads and answers API calls itself, then starts a new standby. A second
figure times a planned handover (SIGTERM: the leader releases its lease on the way out).

Run: .venv/bin/python bench/failover.py [--rounds N] [--smoke]
Prints `figure: failover_s` (median over the rounds; the issue's bound is 5 s), `failover_max_s`
and `handover_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

from tests.helpers import bench, ha, postgres  # noqa: E402


async def measure(url: str, workdir: str, rounds: int) -> tuple[list[float], float]:
    failovers: list[float] = []
    errors: list[str] = []
    async with ha.plane(url, workdir) as p:
        for n in range(rounds + 1):
            leader = await p.wait_leader()
            churn = ha.Churn(p.target, prefix=f"r{n}-")  # the controllers of this round
            churning = asyncio.create_task(churn.run())
            await asyncio.sleep(1.0)
            start = time.monotonic()
            last = n == rounds
            leader.proc.send_signal(signal.SIGTERM if last else signal.SIGKILL)
            await p.wait_leader(other_than=leader, timeout=30)
            took = time.monotonic() - start
            await asyncio.sleep(0.5)
            churn.stop()
            await churning
            errors += churn.errors
            if last:
                handover = took
            else:
                failovers.append(took)
                p.controllers.remove(leader)
                await asyncio.to_thread(p.start_controller)
    if errors:
        raise SystemExit(f"churn saw errors: {errors[:3]}")
    return failovers, handover


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=bench.pick(5, 1))
    parser.add_argument("--smoke", action="store_true", help="tiny mode (same as BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    reason = postgres.unavailable()
    if reason:
        print(f"bench/failover.py needs PostgreSQL: {reason}", file=sys.stderr)
        return 1
    with postgres.running() as server, tempfile.TemporaryDirectory(prefix="rp-failover-") as workdir:
        failovers, handover = asyncio.run(measure(server.database(), workdir, args.rounds))
    print(f"figure: failover_s {statistics.median(failovers):.2f} s")
    print(f"figure: failover_max_s {max(failovers):.2f} s")
    print(f"figure: handover_s {handover:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
