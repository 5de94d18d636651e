"""The OpenAI API's request and response shapes, as far as ``pagedkv serve`` speaks it.

``parse_chat`` / ``parse_completion`` turn a decoded JSON body into an ``ApiRequest``,
or raise ``ApiError`` (status, OpenAI error type, message, offending parameter), which
the app sends back as ``{"error": {...}}``. No MLX here: handlers run it on the event
loop.

Supported: ``messages`` (system / user / assistant, string or text-part content),
``prompt`` (a string, one string in a list, or token ids), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed`` (the same
tokens for the same request and seed, alone or in any batch: ``sample_rows``),
``stream``, ``stream_options.include_usage``, ``n`` = 1. Parameters that would change the output
but are not implemented (``n`` > 1, ``logprobs``, penalties, ``logit_bias``, tools, a
JSON response format, ``echo``, ``suffix``, ``best_of`` > 1) are refused, never ignored.
Unknown parameters are ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs

from pagedkv.errors import InvalidTypeError, InvalidValueError
from pagedkv.serving.engine import Usage
from pagedkv.serving.sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen
class ApiRequest:
    kind: str  # "chat" or "completion"
    model: str
    messages: tuple[dict, ...] | None  # chat
    prompt: str | list[int] | None  # completion
    max_tokens: int | None  # None: as many as fit
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed: int | None = None

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              stop=self.stop, seed=self.seed)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _text(value: str, what: str, param: str) -> str:
    """``value``, or a 400 if it is not valid Unicode: JSON's ``\\ud800`` escapes decode
    to lone surrogates, which no tokenizer (or UTF-8) can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"{what} is not valid Unicode: {e.reason} at {e.start}", param) from None
    return value


def _get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _bad(f"'{name}' must be {names}, got {type(value).__name__}", name)
    return value


def _refuse_unsupported(body: dict) -> None:
    checks = {
        "n": lambda v: v not in (None, 1),
        "best_of": lambda v: v not in (None, 1),
        "logprobs": lambda v: v not in (None, False, 0),
        "top_logprobs": lambda v: v not in (None, 0),
        "presence_penalty": lambda v: v not in (None, 0, 0.0),
        "frequency_penalty": lambda v: v not in (None, 0, 0.0),
        "logit_bias": lambda v: bool(v),
        "tools": lambda v: bool(v),
        "functions": lambda v: bool(v),
        "echo": lambda v: bool(v),
        "suffix": lambda v: bool(v),
        "response_format": lambda v: v not in (None, {"type": "text"}),
    }
    for name, unsupported in checks.items():
        if name in body and unsupported(body[name]):
            raise _bad(f"'{name}' = {body[name]!r} is not supported by pagedkv serve", name)


def _common(body: dict, kind: str, served: str) -> dict:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required (a string)", "model")
    if model != served:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'",
                       type="not_found_error", param="model", code="model_not_found")
    _refuse_unsupported(body)
    limit = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _get(body, limit, (int,))
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    temperature = _get(body, "temperature", (int, float), 1.0)
    top_p = _get(body, "top_p", (int, float), 1.0)
    stop = body.get("stop")
    seed = _get(body, "seed", (int,))
    try:  # the same checks the engine makes, answered as 400s naming the parameter
        checked = SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1,
                                 temperature=temperature, top_p=top_p, stop=stop, seed=seed)
    except (InvalidValueError, InvalidTypeError) as e:
        text = str(e)
        param = next((p for p in ("max_tokens", "temperature", "top_p", "stop", "seed") if text.startswith(p)),
                     None)
        raise _bad(text.replace("max_tokens", limit, 1) if param == "max_tokens" else text, param) from None
    for text in checked.stop:  # (a list of strings by now)
        _text(text, "a stop string", "stop")
    return dict(model=model, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                stop=checked.stop, stream=stream, seed=seed,
                include_usage=bool(stream and _get(options, "include_usage", (bool,), False)))


def _message(i: int, m: object) -> dict:
    if not isinstance(m, dict):
        raise _bad(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise _bad(f"messages[{i}].role must be system, user or assistant, got {role!r}", "messages")
    content = m.get("content")
    if isinstance(content, list):  # text parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content parts must be text parts", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": "system" if role == "developer" else role,
            "content": _text(content, f"messages[{i}].content", "messages")}


def parse_chat(body: object, served: str) -> ApiRequest:
    common = _common(body, "chat", served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    return ApiRequest(kind="chat", messages=tuple(_message(i, m) for i, m in enumerate(messages)),
                      prompt=None, **common)


def parse_completion(body: object, served: str) -> ApiRequest:
    common = _common(body, "completion", served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("'prompt' must be a string, a list with one string, or a non-empty list of "
                       "token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    else:
        _text(prompt, "'prompt'", "prompt")
    return ApiRequest(kind="completion", messages=None, prompt=prompt, **common)


# ---------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _finish(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason)


def response_json(req: ApiRequest, rid: str, text: str, reason: str, usage: Usage) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": req.model, "usage": usage_json(usage)}
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": _finish(reason)}
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(reason)}
    return {**base, "object": "text_completion", "choices": [choice]}


def chunk_json(req: ApiRequest, rid: str, created: int, text: str | None, reason: str | None,
               *, first: bool = False, usage: Usage | None = None) -> dict:
    """One streamed chunk: text (None: no choice, the usage chunk) and maybe a finish."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out: dict = {"id": rid, "object": obj, "created": created, "model": req.model}
    if text is None:
        out["choices"] = []
    elif req.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(reason)}]
    else:
        out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(reason)}]
    if usage is not None:
        out["usage"] = usage_json(usage)
    return out
