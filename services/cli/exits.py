"""replicactl's exit codes and the error that ends a command (also in docs/cli.md)."""

from __future__ import annotations

OK = 0
REFUSED = 1  # the controller refused the call (state, conflict) or a waited-for service failed
BAD_INPUT = 2  # command line, unreadable file, or a spec the controller rejected (INVALID_ARGUMENT)
NOT_FOUND = 3  # no such service, replica or log
UNREACHABLE = 4  # the controller could not be reached
TIMED_OUT = 5  # --wait gave up after --timeout seconds
UNAUTHORIZED = 6  # no token, a wrong one, or one the controller does not accept
INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    """Ends the command with one error line and an exit code.

    Attributes:
        line: the line printed on stderr.
        code: the exit code.
        status: the gRPC status code name when the controller refused the call, else "".
    """

    def __init__(self, line: str, code: int, status: str = "") -> None:
        super().__init__(line)
        self.line = line
        self.code = code
        self.status = status
