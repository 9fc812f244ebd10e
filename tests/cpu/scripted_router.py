"""The scripted router a tests/cpu module sends its requests to: a ScriptedEngineClient (the tokens we
choose) behind a real RouterServer (gRPC + HTTP) on 127.0.0.1, as the module's `engine` and `server`
fixtures, and the reset each test starts from."""

from __future__ import annotations

import pytest

from kvrelay.router.scripted_engine import Script, ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter


def scripted_router_fixtures(scripts: list[Script], *, router: dict | None = None, server_name: str = "server",
                             **engine_kwargs):
    """Module-scoped fixtures, bound at a test module's top level as
    `engine, server = scripted_router_fixtures([SCRIPT], model_name=..., router={"today": ...})`:
    `engine` is ScriptedEngineClient(scripts, **engine_kwargs); `server` the RouterServer in front of it,
    BackgroundRouter(engine, host="127.0.0.1", **router), stopped after the module (named `server_name`
    where the module's tests ask for it by another name)."""

    @pytest.fixture(scope="module")
    def engine() -> ScriptedEngineClient:
        return ScriptedEngineClient(list(scripts), **engine_kwargs)

    @pytest.fixture(scope="module", name=server_name)
    def server(engine):
        with BackgroundRouter(engine, host="127.0.0.1", **(router or {})) as srv:
            yield srv

    return engine, server


def reset(engine: ScriptedEngineClient) -> ScriptedEngineClient:
    """What an earlier test left on the module's engine, cleared: the recorded prompts, params, aborts and
    finishes (so the first script is the one used again), no token delay, one token a batch."""
    for recorded in (engine.prompts, engine.params, engine.aborted, engine.finished):
        recorded.clear()
    engine.token_delay_s = 0.0
    engine.batch = 1
    return engine
