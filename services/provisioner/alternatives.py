"""A spec's resources alternatives, in the order a backend tries them, and what their failures add up to.

SkyPilot lets a spec name several sets of resources: `any_of` (any will do; SkyPilot's optimizer
picks the cheapest), `ordered` (the first that can be had wins) and a list of accelerators
(`accelerators: [A100, H100]`, each a choice). A backend that places replicas itself (the
kubernetes backend) tries them one at a time:

- `ordered`, and a list of accelerators, in the order written, every launch.
- `any_of` in the order written too (there are no prices to rank by), except that an
  alternative which recently found no capacity is tried after the others: any of them will do,
  so a launch need not wait on one known to be full.

An entry whose accelerators are a list becomes one alternative per accelerator, in order.
When every alternative fails, the launch attempt fails with each one's reason; it is the user's
fault only when every alternative was refused for what it asks (a LimitRange, an invalid
quantity), since capacity may come back and then the spec runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from services.provisioner import backend, model

# The fields shown to say which alternative is meant, in this order.
_SHOWN = ("cpus", "memory", "accelerators", "zone")


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One set of resources a replica may run on.

    Attributes:
        path: YAML path of the spec's entry (`resources.any_of[1]`), `resources` without entries.
        resources: its hardware and placement fields (as model.ReplicaSpec.resources), with
            `accelerators` narrowed to one choice.
    """

    path: str
    resources: dict[str, str]

    @property
    def accelerator(self) -> str:
        """The accelerator as NAME:COUNT (`H100:1`), or ""."""
        return self.resources.get("accelerators", "").split(",")[0].strip()

    @property
    def label(self) -> str:
        """The path and what it asks for: `resources.any_of[1] (cpus 2, accelerators H100:1)`."""
        shown = ", ".join(f"{key} {self.resources[key]}" for key in _SHOWN if self.resources.get(key))
        return f"{self.path} ({shown})" if shown else self.path


def of_spec(spec: model.ReplicaSpec) -> list[Alternative]:
    """Every alternative of a spec, in the order written: its any_of/ordered entries (else the top
    level), each accelerator choice of an entry on its own."""
    if spec.alternatives:
        entries = [(f"resources.{spec.alternatives_kind}[{i}]", res) for i, res in enumerate(spec.alternatives)]
    else:
        entries = [("resources", spec.resources)]
    out = []
    for path, res in entries:
        choices = [c.strip() for c in res.get("accelerators", "").split(",") if c.strip()]
        if len(choices) <= 1:
            out.append(Alternative(path, dict(res)))
        else:
            out += [Alternative(path, {**res, "accelerators": choice}) for choice in choices]
    return out


def order(spec: model.ReplicaSpec, found_full: Collection[int]) -> list[int]:
    """The order to try a spec's alternatives in, as indexes into of_spec(spec).

    Args:
        spec: the replica's spec.
        found_full: indexes of alternatives that recently found no capacity; with `any_of` they
            go last (in their written order), otherwise they keep their place.
    """
    indexes = range(len(of_spec(spec)))
    if spec.alternatives_kind != "any_of":
        return list(indexes)
    return [i for i in indexes if i not in found_full] + [i for i in indexes if i in found_full]


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why one alternative could not run.

    Attributes:
        alternative: which.
        message: why, for users (no secrets).
        cause: whose fault.
        permanent: retrying this alternative cannot help.
        capacity: it found no capacity (unschedulable, a quota).
    """

    alternative: Alternative
    message: str
    cause: model.FailureCause
    permanent: bool = False
    capacity: bool = False


def combined(failures: Sequence[Failure]) -> backend.LaunchError:
    """The failure of an attempt in which every alternative failed.

    The user's fault (and permanent) only when every alternative was; otherwise the
    infrastructure's, with `capacity_unavailable` when some alternative found no capacity.
    """
    user = all(f.cause == model.FailureCause.USER for f in failures)
    reasons = "; ".join(f"{f.alternative.label}: {f.message.rstrip('.')}" for f in failures)
    return backend.LaunchError(
        f"no resources alternative could be placed: {reasons}",
        cause=model.FailureCause.USER if user else model.FailureCause.INFRASTRUCTURE,
        permanent=user and all(f.permanent for f in failures),
        capacity_unavailable=not user and any(f.capacity for f in failures),
    )
