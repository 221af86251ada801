"""Run seeded chaos by hand: `python -m tests.chaos --seeds 11,12,13 --rounds 50`, or the
prober fleet outage drill: `python -m tests.chaos --prober-outage 60`.

Prints one line per seed and a summary line `figure: chaos_violations <n> count`; exits 1 if
any invariant was violated.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

from tests.chaos import driver, outage


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("--seeds", default="11,12,13", help="comma-separated seeds, one cluster each")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (write + kill + checks) per seed")
    parser.add_argument("--secure", action="store_true", help="mTLS between the services and a token on the API")
    parser.add_argument(
        "--prober-outage",
        type=float,
        metavar="SECONDS",
        help="run the prober fleet outage drill for this long instead (for example 60)",
    )
    args = parser.parse_args()
    if args.prober_outage is not None:
        sys.exit(outage.main_outage(args.prober_outage))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rp-chaos-") as tmp:
        reports = asyncio.run(driver.run_seeds(seeds, args.rounds, tmp, secure=args.secure))
    rounds = sum(r.rounds for r in reports)
    violations = sum(len(r.violations) for r in reports)
    kills = sum(sum(r.kills.values()) for r in reports)
    print(f"figure: chaos_rounds {rounds} count")
    print(f"figure: chaos_kills {kills} count")
    print(f"figure: chaos_racing_writes {sum(r.racing for r in reports)} count")
    print(f"figure: chaos_unacknowledged_writes {sum(r.unacknowledged for r in reports)} count")
    print(f"figure: chaos_violations {violations} count")
    print(f"figure: chaos_seconds {time.monotonic() - started:.1f} s")
    sys.exit(1 if violations else 0)


if __name__ == "__main__":
    main()
