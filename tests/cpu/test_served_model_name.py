"""--served-model-name: the names a client may use (vLLM's aliases), over HTTP and gRPC."""

from __future__ import annotations


import openai
import pytest

from kvrelay.router import harmony
from kvrelay.router.client import RouterClient
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter


def test_every_served_name_is_listed_and_accepted() -> None:
    reply = harmony.load_encoding().encode("<|channel|>final<|message|>Hi.<|return|>", allowed_special="all")
    engine = ScriptedEngineClient([reply], model_name="gpt-oss-20b", max_context=4096)
    with BackgroundRouter(engine, model_name=["openai/gpt-oss-20b", "gpt-oss"]) as srv:
        with openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="x", max_retries=0, timeout=30) as c:
            assert [m.id for m in c.models.list()] == ["openai/gpt-oss-20b", "gpt-oss"]
            for name in ("openai/gpt-oss-20b", "gpt-oss"):
                r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
                assert r.model == "openai/gpt-oss-20b" and r.choices[0].message.content == "Hi."
            with pytest.raises(openai.NotFoundError):  # the engine's own name is not served under an alias
                c.completions.create(model="gpt-oss-20b", prompt=[1], max_tokens=1)
        with RouterClient(srv.grpc_target, timeout_s=30) as g:
            assert [m.id for m in g.list_models()] == ["openai/gpt-oss-20b", "gpt-oss"]
