"""`make demo` end to end (its Python entry point): stack up, example READY, status, one
request, stack down with nothing left."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_stack import processes_touching
from tests.helpers import procs

pytestmark = pytest.mark.e2e


def test_demo_deploys_the_example_answers_a_request_and_leaves_nothing(tmp_path) -> None:
    state = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.demo", "--state-dir", str(state)],
        cwd=procs.REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "hello is READY (2/2 ready)" in out
    assert "NAME   VERSION  UPTIME  STATUS  REPLICAS  ENDPOINT" in out
    assert '"message": "hello from replica 1"' in out
    assert "through the stack's load balancer" in out
    assert "services left: none" in out
    assert "demo finished in" in out
    assert processes_touching(str(tmp_path), []) == []
