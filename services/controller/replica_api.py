"""The replica calls of the controller's API: listing, reading, terminating, purging and logs
(calls of `Controller`, kept here so the controller class stays small)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.controller import actions, admission, pools, replica_logs

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler


class ReplicaCalls:
    """Replica calls; the controller provides `_get` and `_prov`."""

    _prov: prov_grpc.ProvisionerServiceStub

    def _get(self, name: str) -> ServiceReconciler:
        raise NotImplementedError

    def list_replicas(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Replica], str]:
        """A page of a service's replicas in id order; the token holds the last id of the page."""
        admission.check_page_size(page_size)
        rec = self._get(name)
        ids, token = admission.page(
            sorted(rec.shown), page_size, page_token, kind="replicas", scope=name, position_type=int
        )
        return pools.shown(rec, [rec.shown[i] for i in ids]), token

    def get_replica(self, name: str, replica_id: int) -> res.Replica:
        """One replica (a pool's worker with the job it runs)."""
        rec = self._get(name)
        return pools.shown(rec, [rec.replica(replica_id)])[0]

    async def terminate_replica(self, name: str, replica_id: int, *, purge: bool) -> res.Replica:
        """Terminate one replica (drained), or purge a failed record."""
        return await actions.terminate_replica(self._get(name), replica_id, purge=purge)

    async def purge_replicas(self, name: str) -> list[int]:
        """Purge every failed replica of a service."""
        return await actions.purge_failed(self._get(name))

    def stream_replica_logs(self, name: str, replica_id: int, kind: int, *, follow: bool) -> AsyncIterator[bytes]:
        """A replica's log (app output or launch log) as the provisioner streams it."""
        return replica_logs.stream(self._prov, self._get, name, replica_id, kind, follow=follow)
