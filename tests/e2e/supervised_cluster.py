"""The module-scoped `running` fixture of the supervision e2e tests (test_supervision*.py): the real
cluster of a module's topology with its router on 127.0.0.1 (conftest.serving) and a Supervisor replacing
dead workers as under `kvrelay serve`, checking at the intervals the module asks for."""

from __future__ import annotations

import pytest


def supervised_running(topology: str, *, stall_check_s: float | None = None, **supervisor_kwargs):
    """A fixture `running` -> (RunningCluster, RouterServer), bound at a test module's top level as
    `running = supervised_running(TOPOLOGY, check_every_s=0.5, ...)`: `supervisor_kwargs` go to the
    Supervisor (cluster/supervisor.py); `stall_check_s`, if given, replaces the engine client's
    (conftest's 5 s) as `kvrelay serve` derives it from router.worker_timeout_s."""

    @pytest.fixture(scope="module", name="running")
    def running():
        from conftest import serving

        with serving(topology, supervise=True, **supervisor_kwargs) as (run, server):
            if stall_check_s is not None:
                run.client.stall_check_s = stall_check_s
            yield run, server

    return running
