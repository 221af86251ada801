"""The documented replica name is the one the controller gives: `{service}-{replica_id}-{uid}`.

The proto comments and docs once showed `{service}-{replica_id}`, and the chaos example preempted
`hello-2`, which the provisioner answers NOT_FOUND.
"""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
FULL = "{service}-{replica_id}-{uid}"


def _comment_above(proto: str, field: str) -> str:
    lines = (ROOT / proto).read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if re.search(rf"\b{field} = \d+;", line))
    comment = []
    for line in reversed(lines[:index]):
        if not line.strip().startswith("//"):
            break
        comment.insert(0, line.strip()[2:].strip())
    return " ".join(comment)


def test_proto_comments_give_the_full_replica_name() -> None:
    assert FULL in _comment_above("protos/replicaplane/controller/v1/resources.proto", "string replica_name")
    assert FULL in _comment_above("protos/replicaplane/provisioner/v1/resources.proto", "string name")


def test_the_chaos_example_preempts_a_full_replica_name() -> None:
    doc = (ROOT / "docs" / "provisioner.md").read_text()
    names = [json.loads(m)["name"] for m in re.findall(r"-d '(\{\"name\"[^']*\})'", doc)]
    assert names, "the preemption example is gone"
    for name in names:
        assert re.fullmatch(r"[a-z][-a-z0-9]*-\d+-[0-9a-f]{8}", name), name
