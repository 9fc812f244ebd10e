"""OpenAI-compatible HTTP front-end (FastAPI) over `RouterCore`.

Response shapes follow the conventions in harmony-spec section 10: chain of thought goes out as both
`reasoning_content` (vLLM) and `reasoning` (gpt-oss compatibility test); harmony tool calls become
`tool_calls` with `finish_reason: "tool_calls"`. Errors use OpenAI's `{"error": {...}}` body.

This module holds the app, its routes and the checks of the prompt a request brings; the response bodies
and event streams are built in router/http_streams.py, the tokenizer and Responses routes in
router/tokenizer_api.py and router/responses.py.
"""

from __future__ import annotations

import array
import dataclasses
from typing import Any, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.router import limits
from kvrelay.router import metrics as router_metrics
from kvrelay.router.auth import ApiKeys, install_http
from kvrelay.router.body import OffLoopJsonRoute
from kvrelay.router.health import readiness
from kvrelay.router.limits import RateLimiter
from kvrelay.router.http_errors import error_body, install_error_handlers
from kvrelay.router.http_models import ChatCompletionRequest, CompletionRequest, warn_unknown
from kvrelay.router.http_streams import ChatStream, ChoiceBatch, ChoiceStream, CompletionStream
from kvrelay.router.service import Prepared, RouterCore, encode_prompt_text, new_request_id
from kvrelay.router.types import GenerateRequest
from kvrelay.router.validation import ValidationError, check_token_ids


def create_app(core: RouterCore, api_keys: ApiKeys | None = None, rate_limit: RateLimiter | None = None) -> FastAPI:
    app = FastAPI(title="kvrelay router", docs_url=None, redoc_url=None)
    app.router.route_class = OffLoopJsonRoute  # big JSON bodies are decoded off the event loop
    # The middleware added last runs first: the key check, then the rate limit (only valid keys count).
    limits.install_http(app, rate_limit)
    install_http(app, api_keys or ApiKeys())
    app.add_middleware(limits.BodyLimit)  # before the key check: nothing reads a body over the limit
    router_metrics.install_http(app)  # outermost: counts the key check's and the rate limit's refusals too

    install_error_handlers(app)

    def check_model(model: str | None) -> JSONResponse | None:
        if model and model not in core.model_names:
            return JSONResponse(
                error_body(f"The model '{model}' does not exist; this server serves '{core.model_name}'",
                           param="model", code="model_not_found"),
                status_code=404,
            )
        return None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": core.model_name}

    @app.get("/version")
    async def version() -> Any:
        """What this server runs: kvrelay's version, the git commit and dirty flag, the resolved topology and
        the GPUs (router/version.py). Open like /health: it names code and layout, never a key."""
        info = core.server_info
        if info is None:
            return JSONResponse(error_body("this server was started without its version information"), status_code=404)
        return info.body()

    @app.get("/health/live")
    async def live() -> dict[str, Any]:
        """The router process answers (a liveness probe restarts it when this stops answering)."""
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready() -> Any:
        """Every worker behind the router is up and it is not shutting down (router/health.py)."""
        state = readiness(core.engine)
        return JSONResponse(state.body(core.model_name), status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Prometheus text format of the process's default registry (router/metrics.py, docs/metrics.md);
        # the gauges the workers hold are read now.
        await router_metrics.refresh(core.engine)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "kvrelay", "max_model_len": core.max_context}
                 for name in core.model_names]
        return {"object": "list", "data": cards}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        warn_unknown(body, "/v1/chat/completions")
        n = body.n or 1
        rid = body.request_id or new_request_id("chatcmpl")  # the response's id, in every log line about it
        # to_chat too off the loop: converting a long message list is Python work the loop need not wait on.
        preps = _copies(await core.off_loop(lambda: core.prepare_chat(dataclasses.replace(body.to_chat(),
                                                                                          request_id=rid))), n)
        core.check_admission()
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        streams = [ChatStream(core, prep, include_usage=include_usage and n == 1, index=j,
                              continuous_usage=bool(opts and opts.continuous_usage_stats))
                   for j, prep in enumerate(preps)]
        streams[0].id = rid
        _fork(core, streams, n)
        chat = streams[0] if n == 1 else ChoiceBatch(streams, include_usage=include_usage, n=n)
        if body.stream:
            await chat.prime()
            return StreamingResponse(chat.sse(), media_type="text/event-stream")
        return await chat.complete()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        warn_unknown(body, "/v1/completions")
        sampling = body.sampling()
        prompts = await core.off_loop(_prompt_list, body.prompt, core.max_context, core.vocab_size)
        n = body.n or 1
        preps = []
        base = body.request_id or new_request_id("cmpl")  # the response's id, in every log line about it
        for i, prompt in enumerate(prompts):
            # A batch's prompts are separate requests: their request ids get the prompt's index.
            rid, field = (base, "prompt") if len(prompts) == 1 else (f"{base}-{i}", f"prompt[{i}]")
            req = GenerateRequest(prompt, sampling, rid)  # a tuple, or the array('i') it came as
            preps += _copies(await core.off_loop(lambda: core.prepare_generate(req, prompt_field=field, text=True)),
                             n)
        core.check_admission()
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        streams = [CompletionStream(core, prep, return_token_ids=body.return_token_ids, index=i,
                                    include_usage=include_usage and len(preps) == 1,
                                    continuous_usage=bool(opts and opts.continuous_usage_stats),
                                    echo=body.echo, echo_only=body.echo_only,
                                    prompt_logprobs=body.prompt_logprobs is not None)
                   for i, prep in enumerate(preps)]
        streams[0].id = base
        _fork(core, streams, n)
        comp = streams[0] if len(streams) == 1 else ChoiceBatch(streams, include_usage=include_usage, n=n)
        if body.stream:
            await comp.prime()
            return StreamingResponse(comp.sse(), media_type="text/event-stream")
        return await comp.complete()

    from kvrelay.router import tokenizer_api

    tokenizer_api.add_routes(app, core, check_model, _prompt_ids)
    from kvrelay.router import responses

    responses.add_routes(app, core, check_model)
    return app


MAX_BATCH_PROMPTS = 256


def _copies(prep: Prepared, n: int) -> list[Prepared]:
    """The n choices of one validated (rendered, tokenized once) request: request ids get -j, and a seeded
    request's choice j draws from seed + j, as vLLM's parallel sampling does (a greedy one's choices are
    equal, as OpenAI's are). They run as n engine requests, or as one fork group (`_fork`)."""
    if n == 1:
        return [prep]
    seed = prep.params.seed
    return [dataclasses.replace(prep, request_id=f"{prep.request_id}-{j}",
                                params=prep.params if seed is None else dataclasses.replace(prep.params, seed=seed + j))
            for j in range(n)]


def _fork(core: RouterCore, streams: list[ChoiceStream], n: int) -> None:
    """Each prompt's n choices (streams[i*n:(i+1)*n]) from one prefill, when the engine can fork."""
    if n > 1:
        for i in range(0, len(streams), n):
            for s, tokens in zip(streams[i:i + n], core.fork([s.prep for s in streams[i:i + n]])):
                s.tokens = tokens


def _prompt_list(prompt: Any, max_context: int | None = None, vocab_size: int | None = None) -> list[Sequence[int]]:
    """OpenAI's `prompt`: a string, token ids, or a list of either (a batch: one choice per prompt). Token
    ids may come as array('i') (router/body.py); ids longer than the context or outside the vocabulary
    are refused before they become Python ints (4M ids: ~0.1 s of one call that holds the GIL, as long
    again to free them)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise ValidationError("prompt", f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompt)}")
        if max_context is not None and vocab_size is not None:
            for i, p in enumerate(prompt):  # the field prepare_generate names for a batch's prompt
                _check_ids(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt", max_context, vocab_size)
        return [_prompt_ids(p) for p in prompt]
    if max_context is not None and vocab_size is not None:
        _check_ids(prompt, "prompt", max_context, vocab_size)
    return [_prompt_ids(prompt)]


def _check_ids(prompt: Any, field: str, max_context: int, vocab_size: int) -> None:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)):
        return  # text, or a nested list _prompt_ids refuses
    if len(prompt) >= max_context:
        raise ValidationError(field, f"prompt is {len(prompt)} tokens but the model context is {max_context} "
                              "tokens (at least one token must remain for generation)")
    check_token_ids(prompt, field, vocab_size)


def _prompt_ids(prompt: Any) -> Sequence[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ValidationError("prompt", f"one prompt expected here, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_prompt_text(prompt)
    if isinstance(prompt, array.array):
        return prompt  # compact as router/body.py made it, up to the worker call (engine_prompt)
    return tuple(prompt)  # a tuple: the garbage collector stops walking its ids after one pass, a list's never
