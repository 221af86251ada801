"""Whose fault a failure was: the user's or the infrastructure's. One pure function per backend.

The user's: what the spec asks cannot work (setup or run exits non-zero, a command or image
that does not exist, a missing workdir). The controller stops scaling a version whose replicas
fail this way before ever being ready. The infrastructure's: the failure says nothing about
the spec (no capacity, a quota, an API server that errs or throttles, a full disk, a
provisioner restart). Those are retried with backoff and never stop a version.

When in doubt a failure is the infrastructure's: a wrong "user" stops a healthy version for
good, a wrong "infrastructure" costs a few bounded retries.
"""

from __future__ import annotations

import enum
import errno as errno_mod

from services.provisioner import model

USER = model.FailureCause.USER
INFRASTRUCTURE = model.FailureCause.INFRASTRUCTURE


def of_app_state(app_state: model.AppState) -> model.FailureCause:
    """The cause of an app event a backend did not classify: an exit is the app's own doing;
    a replica that vanished or was preempted was ended from outside."""
    return USER if app_state == model.AppState.EXITED else INFRASTRUCTURE


# ---- local backend -----------------------------------------------------------------------


class Local(enum.Enum):
    """What went wrong in the local backend."""

    SETUP_EXITED = "setup exited non-zero"
    APP_EXITED = "the app exited"
    UNRUNNABLE_SPEC = "the spec asks for what this backend cannot do (num_nodes, an unknown zone)"
    MISSING_FILES = "a workdir or file mount source that is not there, or a mount outside the workdir"
    COPY_FAILED = "copying the workdir or file mounts failed (errno decides)"
    START_FAILED = "a process could not be started"
    NO_ADDRESS = "no free loopback address or port"
    NO_CAPACITY = "the zone refuses launches"
    DELETED_DURING_LAUNCH = "the replica was deleted while its launch ran"
    VANISHED = "the process group ended without an exit code"
    PREEMPTED = "the replica was preempted"
    WORKER_EXITED = "a pool worker's holder process exited: something outside ended it"


# Errors reading the user's files: their files are at fault. Anything else while copying
# (a full or read-only disk, too many open files, I/O errors) is this host's.
_USER_FILE_ERRNOS = frozenset(
    {
        errno_mod.EACCES,
        errno_mod.EPERM,
        errno_mod.ENOENT,
        errno_mod.ENOTDIR,
        errno_mod.EISDIR,
        errno_mod.ELOOP,
        errno_mod.ENAMETOOLONG,
    }
)

_LOCAL = {
    Local.SETUP_EXITED: USER,
    Local.APP_EXITED: USER,
    Local.UNRUNNABLE_SPEC: USER,
    Local.MISSING_FILES: USER,
    Local.START_FAILED: INFRASTRUCTURE,
    Local.NO_ADDRESS: INFRASTRUCTURE,
    Local.NO_CAPACITY: INFRASTRUCTURE,
    Local.DELETED_DURING_LAUNCH: INFRASTRUCTURE,
    Local.VANISHED: INFRASTRUCTURE,
    Local.PREEMPTED: INFRASTRUCTURE,
    Local.WORKER_EXITED: INFRASTRUCTURE,
}


def local(failure: Local, *, errno: int | None = None) -> model.FailureCause:
    """Whose fault a local backend failure was.

    Args:
        failure: what went wrong.
        errno: for COPY_FAILED, the OSError's errno (None when unknown).

    Returns:
        USER or INFRASTRUCTURE.
    """
    if failure == Local.COPY_FAILED:
        return USER if errno in _USER_FILE_ERRNOS else INFRASTRUCTURE
    return _LOCAL[failure]


# ---- kubernetes backend ------------------------------------------------------------------


class Kube(enum.Enum):
    """What went wrong in the kubernetes backend."""

    API_ERROR = "an API call failed (status and message decide)"
    UNRUNNABLE_SPEC = "the spec cannot be expressed as a Pod"
    IMAGE_PULL = "the image could not be pulled (message decides)"
    CONTAINER_ERROR = "the kubelet could not create or start the container"
    SETUP_EXITED = "setup exited non-zero"
    APP_EXITED = "the app exited"
    UNSCHEDULABLE = "the Pod could not be scheduled in time"
    START_TIMEOUT = "the Pod did not start in time"
    DELETED = "the Pod was deleted by someone else"
    DISRUPTED = "the Pod was evicted or preempted"
    WORKER_EXITED = "a pool worker's container exited: something outside ended its holder"


# Statuses that mean the request itself was wrong: the API server refused the object the spec
# produced (an invalid image name, resource quantity, label). Every other refusal (no answer,
# 401/403 access or quota, 404 namespace, 409 conflict, 429, 5xx) is the cluster's or its
# operator's, and may pass once they fix it.
_USER_STATUSES = frozenset({400, 422})

# A pull error whose message says the registry was unreachable or throttled, rather than
# that the image is not there or not accessible.
_REGISTRY_TROUBLE = (
    "toomanyrequests",
    "too many requests",
    "rate limit",
    "429",
    "timeout",
    "timed out",
    "connection refused",
    "connection reset",
    "service unavailable",
    "503",
    "502",
    "500 internal",
    "i/o error",
    "no space left",
)

_KUBE = {
    Kube.UNRUNNABLE_SPEC: USER,
    Kube.CONTAINER_ERROR: USER,
    Kube.SETUP_EXITED: USER,
    Kube.APP_EXITED: USER,
    Kube.UNSCHEDULABLE: INFRASTRUCTURE,
    Kube.START_TIMEOUT: INFRASTRUCTURE,
    Kube.DELETED: INFRASTRUCTURE,
    Kube.DISRUPTED: INFRASTRUCTURE,
    Kube.WORKER_EXITED: INFRASTRUCTURE,
}


def kubernetes(failure: Kube, *, status: int = 0, message: str = "") -> model.FailureCause:
    """Whose fault a kubernetes backend failure was.

    Args:
        failure: what went wrong.
        status: for API_ERROR, the HTTP status (0 when there was no answer).
        message: for API_ERROR and IMAGE_PULL, what the API server or kubelet said.

    Returns:
        USER or INFRASTRUCTURE.
    """
    text = message.lower()
    if failure == Kube.API_ERROR:
        if status == 403 and "usage per" in text and ("maximum" in text or "minimum" in text):
            return USER  # a LimitRange refuses what the spec asks for: it cannot run here
        return USER if status in _USER_STATUSES else INFRASTRUCTURE
    if failure == Kube.IMAGE_PULL:
        return INFRASTRUCTURE if any(hint in text for hint in _REGISTRY_TROUBLE) else USER
    return _KUBE[failure]
