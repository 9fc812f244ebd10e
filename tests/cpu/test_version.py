"""`GET /version` and gRPC `Version` (router/version.py): what a running server says it runs, so that a
benchmark result can name the code and layout that produced it (bench/serve.py records it)."""

from __future__ import annotations

import json
import subprocess

import httpx

from kvrelay.cluster.topology import load_topology
from kvrelay.router.client import RouterClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.version import REPO_ROOT, BuildEnv, BuildInfo, ServerInfo, git_commit, git_dirty

from responses_helpers import FINAL, MODEL
from scripted_router import ScriptedEngineClient

TOPO = load_topology("h100-1gpu-20b-split.yaml")
INFO = ServerInfo(build=BuildInfo("1.2.3", "a" * 40, False), topology=TOPO.to_dict(), topology_source=TOPO.source,
                  device="cuda", gpus=("NVIDIA H100 80GB HBM3",))


def test_version_over_http_and_grpc():
    with BackgroundRouter(ScriptedEngineClient([FINAL], model_name=MODEL), host="127.0.0.1", server_info=INFO) as srv:
        body = httpx.get(f"{srv.http_url}/version", timeout=10).json()
        with RouterClient(srv.grpc_target, timeout_s=30) as g:
            v = g.version()
    assert body == {"version": "1.2.3", "git_commit": "a" * 40, "git_dirty": False,
                    "topology_source": "h100-1gpu-20b-split.yaml", "topology": json.loads(json.dumps(TOPO.to_dict())),
                    "device": "cuda", "gpus": ["NVIDIA H100 80GB HBM3"], "gpus_seen_by": "router"}
    assert body["topology"]["prefill"]["gpu_memory_fraction"] == 0.35 and body["topology"]["model"]["quant"] == "mxfp4"
    assert (v.version, v.git_commit, v.HasField("git_dirty"), v.git_dirty) == ("1.2.3", "a" * 40, True, False)
    assert json.loads(v.topology_json) == body["topology"] and list(v.gpus) == body["gpus"] and v.device == "cuda"


def test_a_server_started_without_a_topology_still_names_its_commit():
    """Read once at start from this checkout (the tests run from one): HEAD and the dirty flag as git says."""
    with BackgroundRouter(ScriptedEngineClient([FINAL], model_name=MODEL), host="127.0.0.1") as srv:
        body = httpx.get(f"{srv.http_url}/version", timeout=10).json()
        with RouterClient(srv.grpc_target, timeout_s=30) as g:
            v = g.version()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    env = BuildEnv.read()
    assert body["git_commit"] == (env.git_commit or head or "unknown")
    assert body["topology"] is None and v.topology_json == "" and v.git_commit == body["git_commit"]


def test_the_environment_overrides_git(tmp_path):
    """A copied tree: KVRELAY_GIT_COMMIT names it, dirty unknown unless KVRELAY_GIT_CLEAN=1 vouches."""
    assert BuildEnv.read({}) == BuildEnv(None, False)
    copied = BuildEnv.read({"KVRELAY_GIT_COMMIT": "b" * 40})
    assert (git_commit(tmp_path, copied), git_dirty(tmp_path, copied)) == ("b" * 40, None)
    vouched = BuildEnv.read({"KVRELAY_GIT_COMMIT": "b" * 40, "KVRELAY_GIT_CLEAN": "1"})
    assert git_dirty(tmp_path, vouched) is False
    # Not a checkout, nothing set: unknown (never the commit of a repository the folder merely sits in).
    inner = REPO_ROOT / ".venv"
    assert (git_commit(tmp_path, BuildEnv()), git_dirty(tmp_path, BuildEnv())) == ("unknown", None)
    if inner.is_dir():
        assert git_commit(inner, BuildEnv()) == "unknown"
