"""OpenAI request bodies → validated parameters (pure; no tokenizer, no I/O).

Every problem raises ``InvalidRequestError`` naming the offending ``param``, so
the client gets an OpenAI-shaped 400 instead of a framework 422/500. Unknown
fields are ignored, as OpenAI-compatible servers commonly do. Integers must fit
int64 (they travel in link frames); the body as a whole (size, depth, finite
numbers, valid strings) was checked before (``request_limits``). A missing
``model`` is accepted, as vLLM does: this server serves one model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from mlxcel_plugin.engine_api import SamplingParams
from mlxcel_plugin.errors import InvalidRequestError
from mlxcel_plugin.logprobs import MAX_TOP_LOGPROBS
from mlxcel_plugin.speculative.settings import METHODS as SPECULATIVE_METHODS
from mlxcel_plugin.structured_output import parse_response_format
from mlxcel_plugin.text.tool_parsers import ToolParser
from mlxcel_plugin.tool_choice import forced_tool_names, tool_call_grammar

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions ``logprobs``
# apply_chat_template's own arguments: a client may not set them (a "chat_template"
# kwarg would run the client's own template on the server).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


@dataclass(frozen=True)
class CommonParams:
    model: str | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_key: str | None = None  # prompt_cache_key


@dataclass(frozen=True)
class ChatParams:
    common: CommonParams
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    forced_tools: tuple[str, ...] | None = None  # tool_choice "required"/named: call one of these


@dataclass(frozen=True)
class CompletionParams:
    common: CommonParams
    prompt: str | list[int]
    echo: bool = False  # the prompt leads the text (and its logprobs, when asked)


# -- typed field readers ------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}': {message}", param=param)


def _show(value: Any) -> str:
    """A value for an error message, cut short (it may be megabytes)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad(name, f"expected an integer, got {_show(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise _bad(name, "must fit a signed 64-bit integer")
    if minimum is not None and value < minimum:
        raise _bad(name, f"must be at least {minimum}, got {value}")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise _bad(name, f"expected a number, got {_show(value)}")
    if not low <= value <= high:
        raise _bad(name, f"must be between {low} and {high}, got {value}")
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"expected a boolean, got {_show(value)}")
    return value


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(name, f"expected a string, got {_show(value)}")
    return value


# -- shared parameters --------------------------------------------------------


def _sampling(body: dict[str, Any]) -> SamplingParams:
    defaults = SamplingParams()
    top_k = _int(body, "top_k", minimum=-1)
    values = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # -1 means disabled (vLLM)
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "seed": _int(body, "seed"),
    }
    if values["top_p"] == 0.0:
        raise _bad("top_p", "must be greater than 0")
    if values["repetition_penalty"] == 0.0:
        raise _bad("repetition_penalty", "must be greater than 0")
    # Unset fields keep the engine defaults (greedy), so parity runs are deterministic.
    chosen = {k: getattr(defaults, k) if v is None else v for k, v in values.items()}
    return SamplingParams(**chosen)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "expected a string or a list of strings")
    return tuple(s for s in value if s)


def _max_tokens(body: dict[str, Any], minimum: int = 1) -> int | None:
    newer = _int(body, "max_completion_tokens", minimum=minimum)
    older = _int(body, "max_tokens", minimum=minimum)
    return newer if newer is not None else older


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat ``logprobs`` (bool) and ``top_logprobs`` (0-20): alternatives, None = off."""
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", minimum=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"must be at most {MAX_TOP_LOGPROBS}, got {top}")
    if top and not wanted:
        raise _bad("top_logprobs", "needs 'logprobs': true (as OpenAI)")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions ``logprobs``: how many alternatives (0-5), None = off."""
    top = _int(body, "logprobs", minimum=0)
    if top is not None and top > MAX_COMPLETION_LOGPROBS:
        raise _bad("logprobs", f"must be at most {MAX_COMPLETION_LOGPROBS}, got {top}")
    return top


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "only allowed when 'stream' is true (as OpenAI)")
    if not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    return _bool(options, "include_usage")


def _reject_unsupported(body: dict[str, Any]) -> None:
    n = _int(body, "n", minimum=1)
    if n is not None and n > 1:
        raise _bad("n", "only n=1 is supported")
    best_of = _int(body, "best_of", minimum=1)
    if best_of is not None and best_of > 1:
        raise _bad("best_of", "only best_of=1 is supported")
    if body.get("suffix") is not None:
        raise _bad("suffix", "suffix is not supported")


def _speculative(body: dict[str, Any]) -> str | None:
    """Extra field ``speculative``: "ngram", "draft" or "off" (docs/speculative.md); None: the
    node's."""
    value = _optional_str(body, "speculative")
    if value is not None and value not in SPECULATIVE_METHODS:
        raise _bad("speculative", f"must be one of {', '.join(SPECULATIVE_METHODS)}, "
                   f"got {_show(value)}")
    return value


def _common(body: dict[str, Any], logprobs: int | None, *, echo: bool = False) -> CommonParams:
    """Shared fields; ``logprobs`` (and, with ``echo``, the prompt's) ride on the sampling."""
    _reject_unsupported(body)
    stream = _bool(body, "stream")
    _optional_str(body, "user")  # unused, but OpenAI refuses a non-string
    sampling = replace(_sampling(body), logprobs=logprobs,
                       prompt_logprobs=logprobs if echo else None,
                       grammar=parse_response_format(body.get("response_format")),
                       speculative=_speculative(body))
    return CommonParams(
        model=_optional_str(body, "model"),
        max_tokens=_max_tokens(body, minimum=0 if echo else 1),  # echo: the prompt alone
        sampling=sampling,
        stop=_stop(body),
        stream=stream,
        include_usage=_include_usage(body, stream),
        cache_key=_optional_str(body, "prompt_cache_key"),  # a routing hint (prefix-aware)
    )


# -- chat ---------------------------------------------------------------------


def _text_content(content: Any, param: str) -> str | None:
    """Flatten string or text-part content; other part types cannot be served."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, "expected a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(param, "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise _bad(param, "a text part needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


def _tool_call_for_template(call: Any, param: str) -> dict[str, Any]:
    # Chat templates expect arguments as a mapping; OpenAI sends JSON text.
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _bad(param, "each tool call needs a 'function' object")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # leave non-JSON arguments as text; the template prints them as given
    return {**call, "function": function}


def _message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(param, "expected an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"{param}.role", f"expected one of {sorted(ROLES)}, got {_show(role)}")
    out = dict(message)
    # Most chat templates only know "system".
    out["role"] = "system" if role == "developer" else role
    out["content"] = _text_content(message.get("content"), f"{param}.content")
    if out["content"] is None and not message.get("tool_calls"):
        raise _bad(f"{param}.content", "a message needs content")
    call_id = message.get("tool_call_id")
    if (role == "tool" or call_id is not None) and not isinstance(call_id, str):
        raise _bad(f"{param}.tool_call_id", "a tool message needs the string 'tool_call_id'")
    _optional_str(message, "name")
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise _bad(f"{param}.tool_calls", "expected a list")
        out["tool_calls"] = [_tool_call_for_template(c, f"{param}.tool_calls") for c in calls]
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not (isinstance(tools, list) and all(map(_is_tool, tools))):
        raise _bad("tools", "expected a list of {'type': 'function', 'function': {'name': ...}}")
    return None if choice == "none" else tools or None


def with_forced_tool_call(params: ChatParams, parser: ToolParser) -> ChatParams:
    """``params`` whose sampling grammar forces the call ``tool_choice`` asks for, if it does."""
    if params.forced_tools is None:
        return params
    if params.common.sampling.grammar is not None:
        raise _bad("tool_choice", "a forced tool call cannot be combined with 'response_format'")
    grammar = tool_call_grammar(params.forced_tools, params.tools or [], parser)
    common = replace(params.common, sampling=replace(params.common.sampling, grammar=grammar))
    return replace(params, common=common)


def _is_tool(tool: Any) -> bool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return False
    function = tool.get("function")
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def parse_chat_request(body: dict[str, Any]) -> ChatParams:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "this field is required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "expected an object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise _bad("chat_template_kwargs", f"cannot set {', '.join(reserved)}")
    tools = _tools(body)
    return ChatParams(
        common=_common(body, _chat_logprobs(body)),
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
        template_kwargs=kwargs,
        forced_tools=forced_tool_names(body.get("tool_choice"), tools),
    )


# -- completions --------------------------------------------------------------


def _prompt(value: Any) -> str | list[int]:
    # The SDK may wrap a single prompt in a list; batches are not supported.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "the prompt is empty")
        return value
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return list(value)
    if isinstance(value, list) and not value:
        raise _bad("prompt", "the prompt is empty")
    raise _bad("prompt", "expected a string or a list of token ids (one prompt per request)")


def parse_completion_request(body: dict[str, Any]) -> CompletionParams:
    if body.get("prompt") is None:
        raise _bad("prompt", "this field is required")
    echo = _bool(body, "echo")
    common = _common(body, _completion_logprobs(body), echo=echo)
    return CompletionParams(common=common, prompt=_prompt(body["prompt"]), echo=echo)
