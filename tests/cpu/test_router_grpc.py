"""gRPC front-end against a scripted engine: streaming, harmony parsing, stop ids, cancellation."""

from __future__ import annotations

import itertools
from dataclasses import replace

import grpc
import pytest

from kvrelay.router import harmony
from kvrelay.router.client import RouterClient, collect_chat
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.types import ChatMessage, ChatRequest, SamplingOptions, ToolCall, ToolSpec
from kvrelay.v1 import router_pb2 as pb
from kvrelay.v1 import router_pb2_grpc as pb_grpc

from scripted_router import reset, scripted_router_fixtures
from waiting import wait_for


DATE = "2025-06-28"
TOOL = ToolSpec("get_weather", "Weather for a city.",
                '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')


def _ids(text: str) -> list[int]:
    return harmony.load_encoding().encode(text, allowed_special="all")


TOOL_CALL_OUTPUT = _ids("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
FINAL_OUTPUT = _ids("<|channel|>analysis<|message|>It said 21C.<|end|><|start|>assistant<|channel|>final"
                    "<|message|>Paris is 21 °C.<|return|>")


engine, server = scripted_router_fixtures([FINAL_OUTPUT], model_name="gpt-oss-test", max_context=4096,
                                          router={"today": lambda: DATE})


@pytest.fixture()
def client(server, engine):
    reset(engine)
    with RouterClient(server.grpc_target, timeout_s=30) as c:
        yield c


def test_health_and_models(client) -> None:
    health = client.health()
    assert health.serving and health.model == "gpt-oss-test"
    (model,) = client.list_models()
    assert model.id == "gpt-oss-test" and model.max_context == 4096


def test_generate_streams_raw_tokens(client, engine) -> None:
    engine.scripts = [[5, 6, 7, 8, 9]]
    out = list(client.generate([1, 2, 3], SamplingOptions(max_tokens=3, logprobs=True, temperature=0)))
    assert [r.token_ids[0] for r in out] == [5, 6, 7]
    assert [r.logprobs[0] for r in out] == [-0.5] * 3
    assert [r.finish_reason for r in out] == [pb.FINISH_REASON_UNSPECIFIED] * 2 + [pb.FINISH_REASON_LENGTH]
    assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens, out[-1].usage.total_tokens) == (3, 3, 6)
    params = engine.params[-1]
    assert params.max_tokens == 3 and params.temperature == 0 and params.stop_token_ids == ()
    assert len({r.request_id for r in out}) == 1 and out[0].request_id.startswith("req-")


def test_generate_stops_on_caller_stop_id(client, engine) -> None:
    engine.scripts = [[5, 6, 42, 8]]
    out = list(client.generate([1], SamplingOptions(stop_token_ids=(42,)), request_id="mine"))
    assert [r.token_ids[0] for r in out] == [5, 6, 42]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP and out[-1].request_id == "mine"
    assert engine.params[-1].max_tokens == 4096 - 1  # default: the rest of the context


def test_chat_tool_call_stream(client, engine) -> None:
    engine.scripts = [TOOL_CALL_OUTPUT]
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?")]
    responses = list(client.chat(msgs, tools=[TOOL], reasoning_effort="low"))
    result = collect_chat(responses)
    assert result.reasoning == "Need the weather."
    assert result.content == ""
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert result.tool_calls[0].id.startswith("call_")
    assert result.finish_reason == "tool_calls"
    assert result.completion_tokens == len(TOOL_CALL_OUTPUT) and result.token_ids == TOOL_CALL_OUTPUT
    # The first tool-call delta names the call; later ones only carry argument text.
    call_deltas = [d for r in responses for d in r.tool_calls]
    assert call_deltas[0].name == "get_weather" and call_deltas[0].arguments == ""
    assert all(d.name == "" and d.id == "" for d in call_deltas[1:])
    # The engine got harmony's rendering and the harmony stop ids.
    expected = harmony.render_chat(ChatRequest(messages=tuple(msgs), tools=(TOOL,), reasoning_effort="low"), DATE)
    assert engine.prompts[-1] == expected
    assert {harmony.RETURN, harmony.CALL} <= set(engine.params[-1].stop_token_ids)
    assert harmony.END not in engine.params[-1].stop_token_ids


def test_chat_tool_result_round_trip(client, engine) -> None:
    engine.scripts = [TOOL_CALL_OUTPUT, FINAL_OUTPUT]
    history = [ChatMessage("user", "Weather in Paris?")]
    first = collect_chat(client.chat(history, tools=[TOOL]))
    history += [first.as_assistant_message(),
                ChatMessage("tool", '{"temp_c": 21}', tool_call_id=first.tool_calls[0].id)]
    second = collect_chat(client.chat(history, tools=[TOOL]))
    assert (second.reasoning, second.content, second.finish_reason) == ("It said 21C.", "Paris is 21 °C.", "stop")
    prompt = harmony.decode_tokens(engine.prompts[-1])
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp_c": 21}<|end|>'
        "<|start|>assistant"
    )


def test_chat_harmony_native_fields(client, engine) -> None:
    """gRPC callers may address harmony directly with channel/recipient."""
    engine.scripts = [FINAL_OUTPUT]
    msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "thinking", channel="analysis"),
            ChatMessage("assistant", '{"city":"Rome"}', recipient="functions.get_weather", channel="commentary"),
            ChatMessage("tool", "sunny", name="get_weather")]
    collect_chat(client.chat(msgs, tools=[TOOL]))
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>" \
           '{"city":"Rome"}<|call|>' in harmony.decode_tokens(engine.prompts[-1])


def test_chat_random_output_becomes_content(client, engine) -> None:
    engine.scripts = [[1000 + i for i in range(100)]]
    result = collect_chat(client.chat([ChatMessage("user", "hi")], sampling=SamplingOptions(max_tokens=100)))
    assert result.content == harmony.decode_tokens([1000 + i for i in range(100)])
    assert result.finish_reason == "length" and result.tool_calls == []


def test_duplicate_request_id_in_flight(server, engine) -> None:
    engine.scripts = [lambda prompt: itertools.cycle([11, 12])]
    engine.token_delay_s = 0.01
    with RouterClient(server.grpc_target) as c:
        first = c.generate([1], request_id="dup")
        next(first)
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate([1], request_id="dup"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "request_id: 'dup' is already in flight"
        first.cancel()
    engine.token_delay_s = 0.0


@pytest.mark.parametrize("rpc", ["generate", "chat"])
def test_client_cancel_aborts_engine(server, engine, rpc: str) -> None:
    engine.aborted.clear()
    engine.scripts = [lambda prompt: itertools.cycle(_ids("<|channel|>final<|message|> and on"))]
    engine.token_delay_s = 0.01
    try:
        with RouterClient(server.grpc_target) as c:
            stream = (c.generate([1, 2], request_id=f"cancel-{rpc}") if rpc == "generate"
                      else c.chat([ChatMessage("user", "go")], request_id=f"cancel-{rpc}"))
            for _ in range(5):
                next(stream)
            stream.cancel()
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.CANCELLED
        assert wait_for(lambda: f"cancel-{rpc}" in engine.aborted), engine.aborted
    finally:
        engine.token_delay_s = 0.0


def test_engine_failure_is_internal_status(server, engine) -> None:
    def boom(prompt):
        yield 5
        raise RuntimeError("device lost")

    engine.scripts = [boom]
    with RouterClient(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
        list(c.generate([1]))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "engine failed: device lost"


@pytest.mark.parametrize("sent", [0, 3])
def test_engine_unavailable_is_unavailable_status(server, engine, sent: int) -> None:
    """No worker took the request within the resume bound: UNAVAILABLE (which gRPC clients may retry),
    before or after tokens went out."""
    from kvrelay.router.engine_client import EngineUnavailable

    def gone(prompt):
        yield from [5] * sent
        raise EngineUnavailable("no live decode worker within 2 s", retry_after_s=3)

    engine.scripts = [gone]
    got = []
    with RouterClient(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
        for resp in c.generate([1]):
            got.extend(resp.token_ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and got == [5] * sent
    assert err.value.details() == "no live decode worker within 2 s (retry after 3 s)"


def test_unknown_reasoning_effort_enum(server) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.RouterStub(channel)
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], reasoning_effort=9)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Chat(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "reasoning_effort: unknown value 9; expected LOW, MEDIUM or HIGH"


def test_harmony_tool_history_via_client_types() -> None:
    """ChatResult.as_assistant_message keeps the call ids the next request refers to."""
    from kvrelay.router.client import ChatResult

    msg = ChatResult(reasoning="r", content="", tool_calls=[ToolCall("call_x", "f", "{}")]).as_assistant_message()
    assert msg.tool_calls[0].id == "call_x" and msg.reasoning == "r"


class _StopIgnoringEngine(ScriptedEngineClient):
    """An engine that ignores stop ids, so the router's own harmony stop has to end the stream."""

    async def generate_batches(self, request_id, prompt_ids, params):
        async for outs in super().generate_batches(request_id, prompt_ids, replace(params, stop_token_ids=())):
            yield outs


@pytest.mark.parametrize("output,reason", [
    ("<|channel|>final<|message|>done<|return|><|start|>assistant<|channel|>final<|message|>extra", "stop"),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>more', "tool_calls"),
])
def test_router_stops_on_harmony_stop_and_aborts_engine(output: str, reason: str) -> None:
    engine = _StopIgnoringEngine([lambda prompt: itertools.chain(_ids(output), itertools.repeat(1000))])
    with BackgroundRouter(engine, today=lambda: DATE) as srv, RouterClient(srv.grpc_target, timeout_s=30) as c:
        result = collect_chat(c.chat([ChatMessage("user", "hi")], tools=[TOOL], request_id="r1"))
        assert result.finish_reason == reason
        ids = _ids(output)
        stop_at = ids.index(harmony.RETURN if reason == "stop" else harmony.CALL)
        assert result.token_ids == ids[: stop_at + 1]  # nothing after the stop token reaches the client
        assert "extra" not in result.content and "more" not in result.content
        assert wait_for(lambda: "r1" in engine.aborted)
