"""What the local backend marks its processes with and where they record their exit codes.

Every replica process carries two environment markers (owner state dir and replica token), and
every job process a third (its job token), so strays that left their process group are still
found and killed. A tiny bash wrapper runs each app or job as a child and writes its exit code to
a file, so the code survives a provisioner restart.
"""

from __future__ import annotations

OWNER_ENV = "REPLICAPLANE_OWNER"
"""Environment marker on every replica process: the owning provisioner's state dir."""
TOKEN_ENV = "REPLICAPLANE_REPLICA_TOKEN"
"""Environment marker on every replica process: the replica incarnation's token."""
JOB_ENV = "REPLICAPLANE_JOB_TOKEN"
"""Environment marker on every job process: the job incarnation's token."""

# Runs the app as a child and records its exit code; killed together with it on teardown.
WRAPPER = 'bash -c "$1"; code=$?; printf "%s" "$code" > "$2"; exit "$code"'
# A pool worker's process after setup: it sleeps until it is killed; SIGTERM ends it at once.
HOLDER = "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done"
EXIT_FILE = "exit_code"
