"""Shared by the Responses API tests (test_http_responses, test_http_responses_refusals) and the chat API's
(test_http_openai): the harmony vocabulary, the scripted model's outputs, and the helpers they use."""

from __future__ import annotations


import httpx

from kvrelay.router import harmony


DATE = "2025-06-28"
MODEL = "gpt-oss-test"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": PARAMS,
          "strict": False}]


def _ids(text: str) -> list[int]:
    return harmony.load_encoding().encode(text, allowed_special="all")


TOOL_CALL = _ids("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
FINAL = _ids("<|channel|>analysis<|message|>Tool said 21.<|end|><|start|>assistant<|channel|>final"
             "<|message|>It is 21 °C in Paris.<|return|>")
PREAMBLE_CALL = _ids("<|channel|>analysis<|message|>Check.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                     "Looking it up.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                     '<|constrain|>json<|message|>{"city":"Paris"}<|call|>')


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/responses", json=body, timeout=30)
