"""The API edge of pools until the controller runs them: a spec that parses as a pool is refused.

The spec package parses pools and the provisioner runs workers and jobs, but this controller
would still treat a pool as a service (launch its workers as replicas, probe them, start a load
balancer). Until the controller's pool side lands, CreateService and UpdateService refuse a pool
with FAILED_PRECONDITION and change nothing.
"""

from __future__ import annotations

from services.common import errors, spec


def refuse_pool(yaml_text: str) -> None:
    """Refuses a spec that is a pool. A spec that does not parse passes: the call's own
    validation reports why, as INVALID_ARGUMENT.

    Raises:
        errors.FailedPreconditionError: the spec is a pool.
    """
    try:
        # No replica cap here: the controller applies its own when it parses the spec again.
        parsed = spec.parse(yaml_text, replica_cap=2**31 - 1)
    except errors.ValidationError:
        return
    if spec.is_pool(parsed):
        raise errors.FailedPreconditionError(
            "pools are not available yet: the controller cannot run jobs or size a pool by its queue "
            "until its pool side lands (the spec is valid)",
            reason="POOLS_NOT_AVAILABLE",
            subject="pool",
            type_="NOT_AVAILABLE",
        )
