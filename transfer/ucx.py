"""UCX's settings for the NIXL agents of a worker process, decided in one place.

UCX (NIXL's transport) reads UCX_TLS and UCX_NET_DEVICES once per process, when the first agent starts,
so every process that may start one must see the same answer before it does: the Ray runtime
environment every worker process starts with (cluster/placement.py puts `env()` there), the worker
itself before its first agent (`apply()`: a worker built outside that environment, as the tests do), and
the follower ranks a TP leader starts (workers/rank_group.py forwards the `ENV_KEYS` of its own
environment). The settings come from the topology's kv_transfer section (cluster/placement.ucx_settings)
and reach each worker in its spec (workers/specs.py).
Here rather than in workers/: they are a property of the transport, not of a role.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_KEYS = ("UCX_TLS", "UCX_NET_DEVICES")


@dataclass(frozen=True)
class UcxSettings:
    tls: str  # UCX_TLS, e.g. "tcp,cma,self"
    net_devices: str | None = None  # UCX_NET_DEVICES: "lo" when everything stays on loopback; None: UCX picks

    def env(self) -> dict[str, str]:
        env = {"UCX_TLS": self.tls}
        if self.net_devices:
            env["UCX_NET_DEVICES"] = self.net_devices
        return env

    def apply(self) -> None:
        """Set them for this process, before any `nixl_agent` exists; explicit environment settings win."""
        for key, value in self.env().items():
            os.environ.setdefault(key, value)
