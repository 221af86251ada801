"""Orphans: replicas the provisioner manages that no replica record of this controller refers to.

A controller reaps its own orphans on every start (a replica it launched but has no record of
is a leak). When its store is lost, the lost services' replicas are such orphans as long as the
controller keeps its id (see identity.py). This module lists them for operators (`replicactl
orphans`) and tears down the ones asked for: this controller's own by default, another owner's
only when named, since another live controller may still use its replicas.

`find` and `select` are pure; `Orphans` talks to the provisioner.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

import grpc

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, pagetoken

log = logging.getLogger(__name__)

MAX_OWNER = 128
MAX_NAMES = 1000
MAX_NAME = 253
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
_LIST_TIMEOUT_S = 10.0
_PROVISIONER_PAGE = 10_000

Records = Mapping[str, Mapping[int, str]]
"""service name -> replica id -> replica name, of every record this controller holds."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A replica named in a reap request that was not reaped, and why."""

    replica_name: str
    reason: str


def _reason(replica: prov_res.ProvisionedReplica, records: Records) -> str:
    ids = records.get(replica.service)
    if ids is None:
        return f'no service "{replica.service}"'
    name = ids.get(replica.replica_id)
    if name is None:
        return f'service "{replica.service}" has no replica {replica.replica_id}'
    return f'replica {replica.replica_id} of service "{replica.service}" is {name} (another incarnation)'


def find(replicas: Iterable[prov_res.ProvisionedReplica], *, records: Records, controller_id: str) -> list[res.Orphan]:
    """The replicas no record refers to, as orphans in name order.

    Args:
        replicas: what the provisioner manages.
        records: this controller's records (service -> replica id -> replica name).
        controller_id: this controller's id.
    """
    referenced = {name for ids in records.values() for name in ids.values()}
    out = []
    for r in replicas:
        if r.name in referenced:
            continue
        orphan = res.Orphan(
            replica_name=r.name,
            service_name=r.service,
            replica_id=r.replica_id,
            version=r.version,
            owner=r.owner,
            owned_by_this_controller=r.owner in ("", controller_id),
            state=prov_res.ReplicaState.Name(r.state).removeprefix("REPLICA_STATE_"),
            endpoint=r.endpoint,
            reason=_reason(r, records),
        )
        if r.HasField("create_time"):
            orphan.create_time.CopyFrom(r.create_time)
        out.append(orphan)
    return sorted(out, key=lambda o: o.replica_name)


def select(
    orphans: list[res.Orphan],
    *,
    owner: str,
    all_owners: bool,
    names: list[str],
    known: set[str],
) -> tuple[list[res.Orphan], list[Skipped]]:
    """Which orphans a reap request covers, and the named replicas it skips with why.

    Args:
        orphans: every orphan now (from `find`).
        owner: another owner whose orphans to reap; "" for this controller's own.
        all_owners: reap every owner's.
        names: only these replicas; empty for all covered.
        known: names of every replica the provisioner manages.
    """

    def covered(o: res.Orphan) -> bool:
        if all_owners:
            return True
        return o.owner == owner if owner else o.owned_by_this_controller

    if not names:
        return [o for o in orphans if covered(o)], []
    by_name = {o.replica_name: o for o in orphans}
    chosen, skipped = [], []
    for name in dict.fromkeys(names):  # each once, in the order given
        o = by_name.get(name)
        if o is not None and covered(o):
            chosen.append(o)
        elif o is not None:
            who = f"controller {o.owner}" if o.owner else "no controller"
            skipped.append(Skipped(name, f"owned by {who}, not this one: pass its id as owner, or all_owners"))
        elif name in known:
            skipped.append(Skipped(name, "not an orphan: a record of this controller refers to it"))
        else:
            skipped.append(Skipped(name, "no such replica at the provisioner"))
    return chosen, skipped


def check_owner(owner: str) -> list[errors.FieldViolation]:
    """Problems of an `owner` field."""
    if len(owner) > MAX_OWNER or not owner.isprintable():
        return [errors.FieldViolation("owner", f"must be a controller id: at most {MAX_OWNER} printable characters")]
    return []


def check_reap(owner: str, all_owners: bool, names: list[str]) -> None:
    """Check a reap request.

    Raises:
        errors.ValidationError: every problem, each naming its field.
    """
    violations = check_owner(owner)
    if owner and all_owners:
        violations.append(errors.FieldViolation("all_owners", "not together with owner"))
    if len(names) > MAX_NAMES:
        violations.append(errors.FieldViolation("replica_names", f"at most {MAX_NAMES} names"))
    else:
        violations += [
            errors.FieldViolation(f"replica_names[{i}]", f"must be a replica name of 1 to {MAX_NAME} characters")
            for i, name in enumerate(names)
            if not name or len(name) > MAX_NAME or not name.isprintable() or any(c.isspace() for c in name)
        ]
    errors.require(violations, subject="reap request")


class Orphans:
    """Lists and reaps this controller's orphans through the provisioner."""

    def __init__(
        self,
        *,
        provisioner: prov_grpc.ProvisionerServiceStub,
        controller_id: str,
        records: Callable[[], Records],
    ) -> None:
        self._prov = provisioner
        self.controller_id = controller_id
        self._records = records
        self._tasks: set[asyncio.Task[None]] = set()

    async def _current(self) -> tuple[builtins.list[res.Orphan], set[str]]:
        """Every orphan now, and every replica name the provisioner manages.

        The provisioner is listed before the records are read: a record is written before its
        launch, so a replica in the listing whose record exists is never taken for an orphan.

        Raises:
            errors.UnavailableError: the provisioner did not answer.
        """
        replicas: builtins.list[prov_res.ProvisionedReplica] = []
        token = ""
        try:
            while True:
                page = await self._prov.ListReplicas(
                    prov_pb.ListReplicasRequest(page_size=_PROVISIONER_PAGE, page_token=token),
                    timeout=_LIST_TIMEOUT_S,
                )
                replicas += page.replicas
                token = page.next_page_token
                if not token:
                    break
        except grpc.aio.AioRpcError as exc:
            raise errors.UnavailableError(
                f"could not list the provisioner's replicas: {exc.code().name}", reason="PROVISIONER_UNAVAILABLE"
            ) from None
        found = find(replicas, records=self._records(), controller_id=self.controller_id)
        return found, {r.name for r in replicas}

    async def list(self, *, owner: str, page_size: int, page_token: str) -> tuple[builtins.list[res.Orphan], str]:
        """One page of orphans (of `owner` only, when given) and the next page's token.

        Raises:
            errors.ValidationError: a malformed owner, page size or page token.
            errors.UnavailableError: the provisioner did not answer.
        """
        violations = check_owner(owner)
        if page_size < 0:
            violations.append(errors.FieldViolation("page_size", f"must be >= 0, got {page_size}"))
        errors.require(violations)
        after = str(pagetoken.decode(page_token, "orphans", owner, position_type=str)) if page_token else ""
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        found, _ = await self._current()
        rest = [o for o in found if o.replica_name > after and (not owner or o.owner == owner)]
        page = rest[:size]
        token = pagetoken.encode("orphans", owner, page[-1].replica_name) if len(rest) > size else ""
        return page, token

    async def reap(
        self, *, owner: str, all_owners: bool, names: builtins.list[str]
    ) -> tuple[builtins.list[res.Orphan], builtins.list[Skipped]]:
        """Start the teardown of the orphans a request covers (see `select`); returns at once.

        Raises:
            errors.ValidationError: a malformed request; nothing is torn down.
            errors.UnavailableError: the provisioner did not answer; nothing is torn down.
        """
        check_reap(owner, all_owners, names)
        found, known = await self._current()
        chosen, skipped = select(found, owner=owner, all_owners=all_owners, names=names, known=known)
        for orphan in chosen:
            log.warning("reaping orphan %s (owner %s): %s", orphan.replica_name, orphan.owner or "none", orphan.reason)
            self.start_teardown(orphan.replica_name)
        return chosen, skipped

    def start_teardown(self, name: str) -> None:
        """Tear replica `name` down in the background (without drain; its logs go with it)."""
        task = asyncio.get_running_loop().create_task(self._teardown(name), name=f"reap {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _teardown(self, name: str) -> None:
        try:
            async for _ in self._prov.Terminate(prov_pb.TerminateRequest(name=name)):
                pass
        except grpc.aio.AioRpcError as exc:
            log.warning("could not tear down orphan %s: %s", name, exc.code().name)

    async def close(self) -> None:
        """Stop teardowns still streaming (the provisioner finishes them anyway)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
