"""What the local backend keeps of each replica incarnation (its `handle.json`)."""

from __future__ import annotations

import dataclasses

from services.provisioner import model


@dataclasses.dataclass
class Handle:
    """Persisted facts about one replica incarnation."""

    name: str
    token: str
    replica_id: int
    zone: str
    price_per_hour: float
    is_spot: bool
    port: int
    port_map: dict[str, int] = dataclasses.field(default_factory=dict)
    setup_pgid: int = 0
    pgid: int = 0
    start_ticks: int = 0
    start_time: float = 0.0
    app_state: str = model.AppState.UNSPECIFIED.value
    exit_code: int = 0
    host: str = "127.0.0.1"
    address: str = ""  # the replica's own loopback address ("address" network), else empty
    env_key: str = ""  # its python environment (pyenvs), shared with its version's replicas
    worker: bool = False  # a pool worker: no port, a holder instead of `run`

    @property
    def endpoint(self) -> str:
        return "" if self.worker else f"http://{self.host}:{self.port}"
