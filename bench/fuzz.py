"""Fuzz the controller's API with hypothesis: specs (create, update, dry run) and requests of
every method, against a real controller server with a scripted provisioner.

Run: .venv/bin/python bench/fuzz.py [--examples N] [--smoke]
Prints `figure: <name> <value> <unit>` lines; a crash is an INTERNAL/UNKNOWN status, an
INVALID_ARGUMENT without field violations, or a failed call that changed state.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

from tests.helpers import bench, fuzzing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=bench.pick(1000, 10), help="hypothesis examples per strategy")
    parser.add_argument("--smoke", action="store_true", help="10 examples, to check the bench runs (BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    logging.basicConfig(level=logging.ERROR)  # the scripted provisioner's warnings are noise here
    started = time.monotonic()
    cases = 0
    crashes: list[str] = []
    codes: dict[str, int] = {}
    for strategy in (fuzzing.spec_requests, fuzzing.requests):
        with tempfile.TemporaryDirectory(prefix="rp-fuzz-") as tmp:
            outcome = fuzzing.run_session(tmp, strategy, args.examples, raise_on_crash=False)
        cases += outcome.cases
        crashes += outcome.crashes
        for code, n in outcome.codes.items():
            codes[code] = codes.get(code, 0) + n
    for line in sorted(set(crashes)):
        print(f"crash: {line[:300]}")
    print("codes: " + ", ".join(f"{k}={v}" for k, v in sorted(codes.items())))
    print(f"figure: fuzz_cases {cases} count")
    print(f"figure: fuzz_crashes {len(crashes)} count")
    print(f"figure: fuzz_seconds {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
