"""The router package imports no torch: its entry modules (router/server.py's RouterServer, the HTTP app in
router/http_api.py, the gRPC service in router/grpc_service.py) build and read only the engine's plain
records (engine/sampling_params.py: SamplingParams, TokenOutput, StructuredOutput), never the sampler or the
model. Torch costs the router ~1.4 s and ~190 MB of start-up for nothing it uses (the commit that split
engine/sampling_params.py out measured it).

What this does NOT claim: `kvrelay serve` (cluster/serve.py) runs the router in its own process, and that
process also defines the workers' Ray actor classes (decode_worker/, prefill_worker/ -> engine/) and so imports
torch; only a process that runs the router alone (router.server over any EngineClient, e.g. the scripted
engine of the tests) stays torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ENTRY = ["kvrelay.router.server", "kvrelay.router.http_api", "kvrelay.router.grpc_service",
         "kvrelay.router.scripted_engine", "kvrelay.engine.sampling_params"]


def _heavy_after_import(modules: list[str]) -> list[str]:
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted(m for m in ('torch', 'triton') if m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ENTRY)
def test_the_router_entry_modules_import_no_torch(module):
    assert "torch" not in _heavy_after_import([module]), f"{module} imports torch"


def test_the_check_sees_torch_where_it_is_imported():
    """The subprocess check is live: the engine's sampler does import torch."""
    assert "torch" in _heavy_after_import(["kvrelay.engine.sampling"])


def test_the_engine_still_finds_the_records_where_it_always_did():
    from kvrelay.engine import sampling, sampling_params, structured
    assert sampling.SamplingParams is sampling_params.SamplingParams
    assert sampling.TokenOutput is sampling_params.TokenOutput
    assert structured.StructuredOutput is sampling_params.StructuredOutput
