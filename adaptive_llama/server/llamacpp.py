"""llama-server's own routes beside the protocols: ``POST /tokenize`` and ``POST /detokenize``,
in llama-server's shapes, for clients that count tokens or inspect a prompt.

``/tokenize``: ``{"content": text, "add_special": false, "parse_special": true,
"with_pieces": false}`` -> ``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id": id,
"piece": text}]}`` (a piece that is not whole UTF-8, part of a character, comes as its list of
bytes). ``add_special`` adds the model's BOS token; ``parse_special`` reads markup such as
``<|im_start|>`` as the control tokens it names.

Both take an optional ``model`` (default: the server's first model).

``/detokenize``: ``{"tokens": [ids]}`` -> ``{"content": text}``, control tokens written out
as their text; an id outside the vocabulary is a 400 that names its index.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel

from .common import STRICT, APIError, parse_body, server_of

router = APIRouter()


class TokenizeBody(BaseModel):
    model_config = STRICT
    model: str | None = None  # None: the server's default model
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def _piece(text: bytes) -> str | list[int]:
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        return list(text)


@router.post("/tokenize")
async def tokenize(request: Request):
    body = await parse_body(request, TokenizeBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        engine = model.engine
        tokens = await asyncio.to_thread(engine.tokenize, body.content, body.add_special,
                                         body.parse_special)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": _piece(engine.piece(t, special=True))}
                           for t in tokens]}


@router.post("/detokenize")
async def detokenize(request: Request):
    body = await parse_body(request, DetokenizeBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        engine = model.engine
        for i, token in enumerate(body.tokens):
            if not 0 <= token < engine.n_vocab:
                raise APIError(400, f"`tokens.{i}`: {token} is not a token of this model "
                               f"(0 to {engine.n_vocab - 1})", param=f"tokens.{i}")
        text = await asyncio.to_thread(
            lambda: b"".join(engine.piece(t, special=True) for t in body.tokens))
    return {"content": text.decode("utf-8", "replace")}
