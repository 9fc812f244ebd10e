"""vLLM-compatible tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Why: benchmark and evaluation clients (lm-eval, guidellm, aiperf) probe these to count tokens or to learn
the tokenizer instead of downloading one, which fails offline. The token ids are the ones the model
sees: plain text through o200k_harmony (no special tokens in text, as for /v1/completions), chat
messages through the same harmony rendering as /v1/chat/completions.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import FastAPI
from pydantic import model_validator
from kvrelay.router import harmony
from kvrelay.router.http_models import BodyModel, ChatCompletionRequest, warn_unknown
from kvrelay.router.validation import ValidationError, json_kind, check_token_ids


class TokenizeCompletion(BodyModel):
    model: Optional[str] = None
    # Any here, checked by the route: a wrong type is then named as `prompt`'s problem, not as the chat
    # form's missing `messages` (the first error of the union).
    prompt: Any = None
    add_special_tokens: bool = True  # accepted as vLLM does; o200k_harmony adds no BOS/EOS to text
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _not_a_chat(cls, data: Any) -> Any:
        # A body with messages is the chat form (its errors are the chat's), never text with extras.
        if isinstance(data, dict) and "messages" in data:
            raise ValueError("a chat body (it has messages)")
        return data


class TokenizeChat(ChatCompletionRequest):
    add_generation_prompt: bool = True  # the rendering always ends with the assistant's turn opening
    return_token_strs: bool = False


class Detokenize(BodyModel):
    model: Optional[str] = None
    tokens: list[int]


def add_routes(app: FastAPI, core, check_model, prompt_ids) -> None:
    """`prompt_ids(text)` is the text -> ids rule of /v1/completions (refuses special tokens in text)."""

    def response(ids: list[int], with_strs: bool) -> dict[str, Any]:
        strs = [harmony.decode_tokens([t]) for t in ids] if with_strs else None
        return {"count": len(ids), "max_model_len": core.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeChat, TokenizeCompletion]) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        warn_unknown(body, "/tokenize")
        if isinstance(body, TokenizeChat):
            ids = list((await core.off_loop(core.prepare_chat, body.to_chat())).prompt_ids)
        elif not isinstance(body.prompt, str):
            raise ValidationError("prompt", "required: the text to tokenize (a string), or messages for a chat"
                                  if body.prompt is None else
                                  f"must be a string (the text to tokenize), got {json_kind(body.prompt)}; a chat "
                                  "is tokenized from messages, and token ids need no tokenizing")
        else:
            ids = await core.off_loop(prompt_ids, body.prompt)
        return response(ids, body.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
        warn_unknown(body, "/detokenize")
        check_token_ids(body.tokens, "tokens", min(core.vocab_size, harmony.VOCAB_SIZE))
        try:
            return {"prompt": harmony.decode_tokens(body.tokens)}
        except Exception as e:  # ids the vocabulary has no text for (unused rows of the embedding)
            raise ValidationError("tokens", f"cannot be decoded: {e}") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        enc = harmony.load_encoding()
        return {"tokenizer_class": "tiktoken", "encoding": "o200k_harmony", "model": core.model_name,
                "vocab_size": harmony.VOCAB_SIZE, "model_max_length": core.max_context,
                "eos_token_ids": list(harmony.CHAT_STOP_TOKEN_IDS),
                "special_tokens": sorted(enc.special_tokens_set)}
