"""Schemathesis over the router's own OpenAPI schema (/openapi.json): every operation the HTTP API lists
gets requests generated from its schema, both valid ones and ones that break it (wrong types, missing
required fields, values outside the declared ranges), sent over a socket to a real router on 127.0.0.1
in front of the scripted engine client. No answer may be a 5xx; every refusal is OpenAI's error body
whose message names what is wrong (a 400's `param` names the field it is about).

Bounded for CI: a fixed number of examples per operation, derandomized (the same cases every run)."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from kvrelay.router import harmony

from scripted_router import scripted_router_fixtures

MODEL = "gpt-oss-schema"
EXAMPLES = int(os.environ.get("KVRELAY_SCHEMATHESIS_EXAMPLES", "20"))
pytestmark = pytest.mark.timeout(300)


REPLY = harmony.load_encoding().encode("<|channel|>final<|message|>schema<|return|>", allowed_special="all")
engine, router = scripted_router_fixtures([REPLY], model_name=MODEL, max_context=4096, router={"model_name": MODEL},
                                          server_name="router")


# The operations fuzzed (method, path). The router's schema must list exactly these: a new route is added
# here, and one that left the schema (say, a handler taking a raw Request) fails the test below instead
# of going unfuzzed. Schemathesis' own pytest wrapper (`from_fixture`) does not run under pytest 9
# (it reads a removed private attribute), so each operation's strategy is driven by hypothesis here.
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/responses/{response_id}/input_items"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/health/live"), ("GET", "/health/ready"), ("GET", "/metrics"),
              ("GET", "/version")]


@pytest.fixture(scope="module")
def api_schema(router):
    return schemathesis.openapi.from_url(f"{router.http_url}/openapi.json")


def error_names_the_problem(ctx, response, case) -> None:
    """A 4xx carries {"error": {"message": ...}}; a 400 names the field in `param` and in the message."""
    if response.status_code < 400:
        return
    body = response.json()
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], response.text
    if response.status_code == 400:
        assert isinstance(err.get("param"), str) and err["param"], response.text
        field = err["param"].split(".")[0].split("[")[0]
        assert field in err["message"], response.text


# Valid requests for every operation; invalid ones where there is a body to break (a path parameter is
# any string, so there is no invalid one to make).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_operation_answers_5xx(api_schema, router, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call(base_url=router.http_url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error, error_names_the_problem])

    run()


def test_the_schema_lists_exactly_the_fuzzed_operations(router):
    paths = httpx.get(f"{router.http_url}/openapi.json").json()["paths"]
    listed = {(m.upper(), p) for p, ops in paths.items() for m in ops}
    assert listed == set(OPERATIONS)
    # The operations fuzzed only with valid requests take no body, and no parameter but a path's string.
    for m, p in OPERATIONS:
        if m != "POST":
            op = paths[p][m.lower()]
            assert "requestBody" not in op and all(q["in"] == "path" for q in op.get("parameters", ())), (m, p)


def test_a_body_that_is_not_utf8_is_named_invalid_json(router):
    """Found by the negative cases above: FastAPI's own "There was an error parsing the body" named no field."""
    r = httpx.post(f"{router.http_url}/v1/chat/completions", content=b'{"messages": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    assert r.json()["error"]["message"].startswith("body: not valid JSON: not UTF-8 text ("), r.text
