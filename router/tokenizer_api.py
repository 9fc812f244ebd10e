"""vLLM-compatible tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Why: benchmark and evaluation clients (lm-eval, guidellm, aiperf) probe these to count tokens or to learn
the tokenizer instead of downloading one, which fails offline. The token ids are the ones the model
sees: plain text through o200k_harmony (no special tokens in text, as for /v1/completions), chat
messages through the same harmony rendering as /v1/chat/completions.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from kvrelay.router import harmony
from kvrelay.router.http_models import ChatCompletionRequest
from kvrelay.router.validation import ValidationError, check_token_ids


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True  # accepted as vLLM does; o200k_harmony adds no BOS/EOS to text
    return_token_strs: bool = False


class TokenizeChat(ChatCompletionRequest):
    add_generation_prompt: bool = True  # the rendering always ends with the assistant's turn opening
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
        if isinstance(body, TokenizeChat):
            ids = list((await core.off_loop(core.prepare_chat, body.to_chat())).prompt_ids)
        else:
            ids = await core.off_loop(prompt_ids, body.prompt)
        return response(ids, body.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> Any:
        if (bad := check_model(body.model)) is not None:
            return bad
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
