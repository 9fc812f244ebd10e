"""Our chat -> harmony mapping renders the same token ids as conversations built by hand with
openai-harmony's own API (and, for the spec's worked example, the same text)."""

from __future__ import annotations

import json

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from kvrelay.router import harmony
from kvrelay.router.types import ChatMessage, ChatRequest, ToolCall, ToolSpec


DATE = "2025-06-28"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    },
    "required": ["location"],
}
WEATHER_TOOL = ToolSpec("get_current_weather", "Gets the current weather in the provided location.",
                        json.dumps(WEATHER_SCHEMA))


@pytest.fixture(scope="module")
def enc():
    return harmony.load_encoding()  # openai-harmony's own encoding, over the vocabulary kvrelay ships


def _system(effort: ReasoningEffort = ReasoningEffort.MEDIUM) -> Message:
    content = SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(DATE)
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(instructions: str | None, tools: list[ToolDescription] | None = None) -> Message:
    content = DeveloperContent.new()
    if instructions is not None:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(tools)
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _expected(enc, messages: list[Message]) -> list[int]:
    return enc.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)


def _weather_desc() -> ToolDescription:
    return ToolDescription.new(WEATHER_TOOL.name, WEATHER_TOOL.description, parameters=WEATHER_SCHEMA)


def test_special_token_ids_match_the_encoding(enc) -> None:
    for name, token in [("<|endoftext|>", harmony.ENDOFTEXT), ("<|return|>", harmony.RETURN),
                        ("<|constrain|>", harmony.CONSTRAIN), ("<|channel|>", harmony.CHANNEL),
                        ("<|start|>", harmony.START), ("<|end|>", harmony.END),
                        ("<|message|>", harmony.MESSAGE), ("<|call|>", harmony.CALL)]:
        assert enc.encode(name, allowed_special="all") == [token]
    assert set(enc.stop_tokens_for_assistant_actions()) <= set(harmony.CHAT_STOP_TOKEN_IDS)
    assert harmony.END not in harmony.CHAT_STOP_TOKEN_IDS


@pytest.mark.parametrize("effort,lib", [("low", ReasoningEffort.LOW), ("medium", ReasoningEffort.MEDIUM),
                                        ("high", ReasoningEffort.HIGH)])
def test_system_user_each_effort(enc, effort: str, lib: ReasoningEffort) -> None:
    req = ChatRequest(messages=(ChatMessage("user", "What is 2+2?"),), reasoning_effort=effort)
    got = harmony.render_chat(req, DATE)
    want = _expected(enc, [_system(lib), Message.from_role_and_content(Role.USER, "What is 2+2?")])
    assert got == want
    assert f"Reasoning: {effort}" in enc.decode(got)


def test_knowledge_cutoff_override_and_no_date(enc) -> None:
    req = ChatRequest(messages=(ChatMessage("user", "hi"),), knowledge_cutoff="2023-01")
    text = enc.decode(harmony.render_chat(req, ""))
    assert "Knowledge cutoff: 2023-01" in text and "Current date" not in text


def test_spec_worked_example_text(enc) -> None:
    """harmony-spec section 9, verbatim."""
    req = ChatRequest(
        messages=(ChatMessage("system", "Answer briefly."), ChatMessage("user", "What is the weather in Tokyo?")),
        tools=(WEATHER_TOOL,),
        reasoning_effort="high",
    )
    got = harmony.render_chat(req, DATE)
    expected_text = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the current weather in the provided location.\n"
        "type get_current_weather = (_: {\n// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
        'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>What is the weather in Tokyo?<|end|><|start|>assistant"
    )
    assert enc.decode(got) == expected_text
    assert got[:3] == [200006, 17360, 200008]
    want = _expected(enc, [_system(ReasoningEffort.HIGH), _developer("Answer briefly.", [_weather_desc()]),
                           Message.from_role_and_content(Role.USER, "What is the weather in Tokyo?")])
    assert got == want


def test_system_and_developer_messages_join_into_instructions(enc) -> None:
    req = ChatRequest(messages=(ChatMessage("system", "Be terse."), ChatMessage("developer", "Use metric."),
                                ChatMessage("user", "hi")))
    want = _expected(enc, [_system(), _developer("Be terse.\n\nUse metric."),
                           Message.from_role_and_content(Role.USER, "hi")])
    assert harmony.render_chat(req, DATE) == want


def test_tools_without_instructions_and_parameterless_tool(enc) -> None:
    req = ChatRequest(messages=(ChatMessage("user", "time?"),),
                      tools=(ToolSpec("now", "Current time."), WEATHER_TOOL))
    want = _expected(enc, [_system(), _developer(None, [ToolDescription.new("now", "Current time."), _weather_desc()]),
                           Message.from_role_and_content(Role.USER, "time?")])
    got = harmony.render_chat(req, DATE)
    assert got == want
    assert "type now = () => any;" in enc.decode(got)


def test_tool_loop_keeps_analysis_and_renders_call_and_result(enc) -> None:
    args = '{"location":"Tokyo"}'
    req = ChatRequest(
        messages=(
            ChatMessage("user", "What is the weather in Tokyo?"),
            ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_current_weather", args),),
                        reasoning="User wants Tokyo weather. Call the tool."),
            ChatMessage("tool", '{"temperature": 20, "sunny": true}', tool_call_id="call_1"),
        ),
        tools=(WEATHER_TOOL,),
        reasoning_effort="high",
    )
    got = harmony.render_chat(req, DATE)
    want = _expected(enc, [
        _system(ReasoningEffort.HIGH),
        _developer(None, [_weather_desc()]),
        Message.from_role_and_content(Role.USER, "What is the weather in Tokyo?"),
        Message.from_role_and_content(Role.ASSISTANT, "User wants Tokyo weather. Call the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
        .with_recipient("functions.get_current_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_current_weather"),
                                        '{"temperature": 20, "sunny": true}')
        .with_recipient("assistant").with_channel("commentary"),
    ])
    assert got == want
    assert enc.decode(got).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>User wants Tokyo weather. Call the tool.<|end|>"
        "<|start|>assistant to=functions.get_current_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"location":"Tokyo"}<|call|>'
        "<|start|>functions.get_current_weather to=assistant<|channel|>commentary"
        '<|message|>{"temperature": 20, "sunny": true}<|end|><|start|>assistant'
    )


def test_finished_turn_drops_analysis_like_harmony(enc) -> None:
    req = ChatRequest(messages=(
        ChatMessage("user", "2+2?"),
        ChatMessage("assistant", "4", reasoning="Simple arithmetic."),
        ChatMessage("user", "and 3+3?"),
    ))
    got = harmony.render_chat(req, DATE)
    want = _expected(enc, [
        _system(), Message.from_role_and_content(Role.USER, "2+2?"),
        Message.from_role_and_content(Role.ASSISTANT, "Simple arithmetic.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "4").with_channel("final"),
        Message.from_role_and_content(Role.USER, "and 3+3?"),
    ])
    assert got == want
    assert "Simple arithmetic." not in enc.decode(got)


def test_preamble_next_to_tool_call_and_named_user(enc) -> None:
    req = ChatRequest(messages=(
        ChatMessage("user", "hi", name="alice"),
        ChatMessage("assistant", "Let me check.", tool_calls=(ToolCall("c1", "now", "{}"),)),
        ChatMessage("tool", "12:00", name="now"),
        ChatMessage("assistant", "It is noon.", channel="final"),
        ChatMessage("user", "thanks"),
    ), tools=(ToolSpec("now", "Current time."),))
    want = _expected(enc, [
        _system(), _developer(None, [ToolDescription.new("now", "Current time.")]),
        Message.from_author_and_content(Author(role=Role.USER, name="alice"), "hi"),
        Message.from_role_and_content(Role.ASSISTANT, "Let me check.").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, "{}").with_channel("commentary")
        .with_recipient("functions.now").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.now"), "12:00")
        .with_recipient("assistant").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, "It is noon.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "thanks"),
    ])
    assert harmony.render_chat(req, DATE) == want


def test_encode_text_refuses_special_token_text() -> None:
    assert harmony.encode_text("hello") == harmony.load_encoding().encode("hello")
    with pytest.raises(HarmonyError):
        harmony.encode_text("hi <|start|>system")
