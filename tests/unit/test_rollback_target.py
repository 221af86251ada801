"""Which version a rollback goes back to."""

from __future__ import annotations

import pytest

from services.controller.domain import history as h

A, S, R, F = h.ACTIVE, h.SUPERSEDED, h.ROLLED_BACK, h.FAILED


def kept(*outcomes: int) -> list[h.Kept]:
    return [h.Kept(i + 1, o) for i, o in enumerate(outcomes)]


@pytest.mark.parametrize(
    ("history", "to", "want"),
    [
        (kept(S, A), 0, 1),
        (kept(S, S, A), 0, 2),
        (kept(S, R, A), 0, 1),  # a rolled back version never served: skipped
        (kept(S, F, A), 0, 1),
        (kept(S, S, A), 1, 1),
        (kept(S, R, A), 2, 2),  # asked by number: allowed
    ],
)
def test_rollback_target(history: list[h.Kept], to: int, want: int) -> None:
    assert h.rollback_target(history, latest=len(history), to=to) == want


@pytest.mark.parametrize(
    ("history", "to", "message"),
    [
        (kept(A), 0, "no earlier version that served to go back to"),
        (kept(R, A), 0, "no earlier version that served to go back to"),
        (kept(S, A), 2, "version 2 is the latest version already"),
        (kept(S, A), 7, "version 7 is not in the history (kept: 1, 2)"),
        ([h.Kept(3, S), h.Kept(4, S), h.Kept(5, A)], 1, "version 1 is not in the history (kept: 3..5)"),
    ],
)
def test_no_rollback_target(history: list[h.Kept], to: int, message: str) -> None:
    with pytest.raises(h.NoTarget, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        h.rollback_target(history, latest=max(k.version for k in history), to=to)
