"""Harmony rendering: typed chat requests -> prompt token ids, via openai-harmony's own renderer.

We build harmony `Message`s and let the library render them, so prompts are byte-identical to what the
model was trained on (including 0.0.8's rule for dropping earlier turns' analysis). Our part is the
mapping from chat-style messages (OpenAI conventions, spec section 10.1) onto harmony authors, channels
and recipients.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from kvrelay.router.types import ChatMessage, ChatRequest

# Special token ids of o200k_harmony (spec 1.2); fixed by the vocabulary, checked against the encoding
# in tests so a mismatch cannot go unnoticed.
ENDOFTEXT = 199999
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012
VOCAB_SIZE = 201088  # rows of the model's embedding table; ids >= this must never reach the engine

# Sampling stops for assistant turns: <|return|> ends the answer, <|call|> hands over to a tool.
# <|endoftext|> is a safety stop (HF generation_config lists it too). Never <|end|>: the model uses it
# between its analysis and final messages within one turn.
CHAT_STOP_TOKEN_IDS = (RETURN, CALL, ENDOFTEXT)

DEFAULT_KNOWLEDGE_CUTOFF = "2024-06"
TOOL_NAMESPACE = "functions"

_EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
_VOCAB_FILE = "o200k_base.tiktoken"


class VocabularyMissingError(RuntimeError):
    pass


def use_vocab_dir(path: Path | str) -> None:
    """Point harmony at `path` unless $TIKTOKEN_ENCODINGS_BASE already says where the vocabulary is."""
    base = os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(path))
    if not (Path(base) / _VOCAB_FILE).is_file():
        raise VocabularyMissingError(
            f"{_VOCAB_FILE} not found in {base} (TIKTOKEN_ENCODINGS_BASE); the harmony tokenizer needs it "
            "offline. Copy it there or set TIKTOKEN_ENCODINGS_BASE to a folder that holds it."
        )


@functools.lru_cache(maxsize=1)
def load_encoding() -> HarmonyEncoding:
    """The gpt-oss encoding, loaded offline from $TIKTOKEN_ENCODINGS_BASE.

    Without the variable, openai-harmony tries to download the vocabulary and fails on machines with no
    network with an unhelpful message, so we check first and say how to fix it.
    """
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not base:
        raise VocabularyMissingError(
            "TIKTOKEN_ENCODINGS_BASE is not set: point it at a folder holding "
            f"{_VOCAB_FILE} (this checkout keeps one in ../shared/tokenizer)"
        )
    if not (Path(base) / _VOCAB_FILE).is_file():
        raise VocabularyMissingError(f"TIKTOKEN_ENCODINGS_BASE={base} has no {_VOCAB_FILE}")
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


ENCODE_CHUNK_CHARS = 1 << 14
# " X" after a non-space, where X is a letter: the tokenizer's pieces never span this boundary (the
# space opens the next word's piece), so encoding the two sides apart gives the same ids.
_SPLIT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def encode_text(text: str) -> list[int]:
    """Plain text -> ids. Text spelling a special token (e.g. "<|start|>") raises HarmonyError rather
    than being encoded either way: callers that mean special tokens must send token ids.

    Long text is encoded in ~16 KB pieces cut where no token can span: the encoder holds the GIL for
    the whole call (~0.2 s per MB), and pieces let the router's event loop run in between."""
    enc = load_encoding()
    if len(text) <= ENCODE_CHUNK_CHARS:
        return enc.encode(text, allowed_special=set())
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = start + ENCODE_CHUNK_CHARS
        if end < len(text):
            cut = _SPLIT.search(text, end, end + ENCODE_CHUNK_CHARS)
            end = cut.start() if cut is not None else len(text)  # no safe cut near: take the rest whole
        ids += enc.encode(text[start:end], allowed_special=set())
        start = end
        time.sleep(0)  # hand the GIL to a waiting thread (the event loop) between pieces
    return ids


def decode_tokens(token_ids: list[int] | tuple[int, ...]) -> str:
    return load_encoding().decode(list(token_ids), errors="replace")


def system_message(effort: str, start_date: str, knowledge_cutoff: str) -> Message:
    content = (
        SystemContent.new()
        .with_reasoning_effort(_EFFORTS[effort])
        .with_knowledge_cutoff(knowledge_cutoff or DEFAULT_KNOWLEDGE_CUTOFF)
    )
    if start_date:
        content = content.with_conversation_start_date(start_date)
    return Message.from_role_and_content(Role.SYSTEM, content)


def tool_descriptions(request: ChatRequest) -> list[ToolDescription]:
    tools = []
    for spec in request.tools:
        params = json.loads(spec.parameters_json) if spec.parameters_json.strip() else None
        tools.append(ToolDescription.new(spec.name, spec.description, parameters=params))
    return tools


def developer_message(request: ChatRequest) -> Message | None:
    """System and developer chat messages become the developer `# Instructions` (spec 10.1); the
    harmony system message itself is generated by the server."""
    instructions = [m.content for m in request.messages if m.role in ("system", "developer") and m.content]
    tools = tool_descriptions(request)
    formats = response_formats_section(request)
    if tools and formats:
        # With tools the message must stay a DeveloperContent (harmony's system message names the tool
        # channel only when it sees function tools), and 0.0.8's has no response-format field: the
        # section goes at the end of the instructions, before `# Tools`.
        instructions.append(formats)
        formats = ""
    if not instructions and not tools:
        return Message.from_role_and_content(Role.DEVELOPER, formats) if formats else None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions("\n\n".join(instructions))
    if tools:
        content = content.with_function_tools(tools)
    message = Message.from_role_and_content(Role.DEVELOPER, content)
    if not formats:
        return message
    # No tools: render the instructions as harmony does and append the section after them (as harmony's
    # docs show it), sending the whole as the developer message's text.
    text = load_encoding().decode(load_encoding().render(message))
    body = text[text.index("<|message|>") + len("<|message|>"): text.rindex("<|end|>")]
    return Message.from_role_and_content(Role.DEVELOPER, f"{body}\n\n{formats}")


def response_formats_section(request: ChatRequest) -> str:
    """harmony's `# Response Formats` developer section (spec 5) for a json_schema response_format."""
    rf = request.response_format
    if rf is None or rf.type != "json_schema" or not rf.schema_json.strip():
        return ""
    lines = ["# Response Formats", "", f"## {rf.name or 'response'}", ""]
    if rf.description:
        lines.append(f"// {rf.description}")
    lines.append(json.dumps(json.loads(rf.schema_json), separators=(",", ":")))
    return "\n".join(lines)


def tool_call_names(messages: tuple[ChatMessage, ...]) -> dict[str, str]:
    """tool_call_id -> function name, from the assistant messages' tool calls."""
    return {call.id: call.name for m in messages if m.role == "assistant" for call in m.tool_calls if call.id}


def _author(role: Role, name: str) -> Author:
    return Author(role=role, name=name or None)


def assistant_messages(msg: ChatMessage) -> list[Message]:
    out: list[Message] = []
    if msg.reasoning:
        # harmony 0.0.8 drops it again when the conversation's last assistant message is final; it
        # survives only while a tool loop is in progress, which is when the model needs it.
        out.append(
            Message.from_author_and_content(_author(Role.ASSISTANT, msg.name), msg.reasoning).with_channel("analysis")
        )
    if msg.content:
        # Text next to tool calls is a preamble (commentary without recipient), the only place a model
        # writes user-visible text before calling; otherwise it is the turn's final answer.
        default_channel = "commentary" if msg.tool_calls else "final"
        m = Message.from_author_and_content(_author(Role.ASSISTANT, msg.name), msg.content)
        m = m.with_channel(msg.channel or default_channel)
        if msg.recipient:
            m = m.with_recipient(msg.recipient)
            if msg.recipient.startswith(f"{TOOL_NAMESPACE}."):
                m = m.with_content_type("<|constrain|>json")
        out.append(m)
    for call in msg.tool_calls:
        m = Message.from_author_and_content(_author(Role.ASSISTANT, msg.name), call.arguments)
        out.append(
            m.with_channel("commentary")
            .with_recipient(f"{TOOL_NAMESPACE}.{call.name}")
            .with_content_type("<|constrain|>json")
        )
    return out


def tool_result_message(msg: ChatMessage, names: dict[str, str]) -> Message:
    name = msg.name or names[msg.tool_call_id]
    author = Author.new(Role.TOOL, f"{TOOL_NAMESPACE}.{name}")
    return (
        Message.from_author_and_content(author, msg.content)
        .with_recipient("assistant")
        .with_channel("commentary")
    )


def to_harmony(request: ChatRequest, start_date: str) -> list[Message]:
    """The whole conversation as harmony messages. Assumes `validation` accepted the request."""
    out = [system_message(request.reasoning_effort, start_date, request.knowledge_cutoff)]
    dev = developer_message(request)
    if dev is not None:
        out.append(dev)
    names = tool_call_names(request.messages)
    for msg in request.messages:
        if msg.role == "user":
            out.append(Message.from_author_and_content(_author(Role.USER, msg.name), msg.content))
        elif msg.role == "assistant":
            out.extend(assistant_messages(msg))
        elif msg.role == "tool":
            out.append(tool_result_message(msg, names))
        # system/developer were folded into the developer message above
    return out


def render_chat(request: ChatRequest, start_date: str) -> list[int]:
    """Prompt ids ending in `<|start|>assistant`, ready for sampling."""
    conversation = Conversation.from_messages(to_harmony(request, start_date))
    return load_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)
