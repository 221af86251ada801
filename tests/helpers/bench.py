"""What the benchmarks in bench/ share: the tiny mode `make bench-smoke` runs them in."""

from __future__ import annotations

import os
import sys
from typing import TypeVar

T = TypeVar("T")

SMOKE = os.environ.get("BENCH_SMOKE", "") not in ("", "0") or "--smoke" in sys.argv[1:]
"""True for BENCH_SMOKE=1 or --smoke: every step of the bench runs, on tiny sizes, so a bench that
no longer runs is found in CI. Its figures then measure nothing."""


def pick(full: T, smoke: T) -> T:
    """`full`, or `smoke` in the tiny mode."""
    return smoke if SMOKE else full


def announce() -> None:
    """Say on stdout that the figures below come from the tiny mode."""
    if SMOKE:
        print("smoke mode (BENCH_SMOKE=1 or --smoke): tiny sizes; the figures are not measurements", flush=True)
