"""Conversions between the stored protobuf records and the domain's plain types."""

from __future__ import annotations

from replicaplane.controller.v1 import resources_pb2
from services.common import pbtime
from services.controller.domain import status as st


def facts_of(replica: resources_pb2.Replica) -> st.Facts:
    """The domain facts of a stored replica."""
    f = replica.facts
    return st.Facts(
        launch=st.LaunchPhase(f.launch_phase),
        teardown=st.TeardownPhase(f.teardown_phase),
        user_app_failed=f.user_app_failed,
        ready_now=f.ready_now,
        first_ready_time=pbtime.from_timestamp(f.first_ready_time) if f.HasField("first_ready_time") else None,
        initial_delay_exceeded=f.initial_delay_exceeded,
        is_scale_down=f.is_scale_down,
        preempted=f.preempted,
        purged=f.purged,
        failed_spot_availability=f.failed_spot_availability,
    )


def status_of(replica: resources_pb2.Replica) -> st.ReplicaStatus:
    """The derived status of a stored replica."""
    return st.replica_status(facts_of(replica))


def view_of(replica: resources_pb2.Replica) -> st.ReplicaView:
    """What scaling rules need of a replica. Uses the status stored with the record, which every
    change refreshes, so large services do not re-derive it on each pass."""
    return st.ReplicaView(
        replica_id=replica.replica_id,
        version=replica.version,
        status=st.ReplicaStatus(replica.status),
        is_spot=replica.is_spot,
    )
