"""Logprobs and ``echo`` in OpenAI bodies and stream chunks (pure given a tokenizer).

A ``Completion`` gathers each text token's logprobs (``Completion.logprobs``)
and, for ``echo``, the prompt's (``Completion.prompt_logprobs``); this module
renders them as OpenAI does:

* chat: ``choices[0].logprobs = {"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  with ``echo`` the prompt's tokens first (the very first has no logprob:
  ``null``); ``top_logprobs`` maps token text → logprob and holds the chosen
  token too (as vLLM), ``text_offset`` counts characters of the returned text.

A token's text is ``tokenizer.decode([id])`` (a piece of a multi-byte
character reads as U+FFFD, as in vLLM); ``bytes`` is that text's UTF-8.
Bodies depend only on the token stream, so router and hybrid stay byte-identical.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from mlxcel_plugin.logprobs import TokenLogprobs
from mlxcel_plugin.text import TextDelta, TextTokenizer
from router_plugin.http import bodies as responses
from router_plugin.http import sse
from router_plugin.http.completion import Completion, Echo
from router_plugin.http.openai_schema import CompletionParams

# (token id, its logprobs or None: the prompt's first token)
Entry = tuple[int, TokenLogprobs | None]


class LogprobsView:
    """What one response reports, taken piece by piece (a stream) or all at once."""

    def __init__(self, completion: Completion, tokenizer: TextTokenizer):
        self.completion = completion
        self._texts: dict[int, str] = {}
        self._decode = tokenizer.decode
        self._taken = 0  # completion.logprobs already reported
        self._echoed = False
        self._offset = 0  # characters of text reported so far (completions' text_offset)

    def take(self) -> tuple[str, list[Entry]]:
        """The echo (once, first) and the tokens not reported yet."""
        prefix, entries = "", []
        echo = self.completion.echo
        if echo is not None and not self._echoed:
            self._echoed = True
            prefix = echo.text
            if self.completion.wants_logprobs:
                entries = self._prompt_entries()
        entries += self.completion.logprobs[self._taken :]
        self._taken = len(self.completion.logprobs)
        return prefix, entries

    @property
    def pending(self) -> bool:
        echo_due = self.completion.echo is not None and not self._echoed
        return echo_due or self._taken < len(self.completion.logprobs)

    def _prompt_entries(self) -> list[Entry]:
        prompt = self.completion.request.prompt_tokens
        found = self.completion.prompt_logprobs
        if found is None or len(found) != len(prompt) - 1:  # a node that did not report them
            return [(token, None) for token in prompt]
        return [(prompt[0], None)] + [(t, found.token(i)) for i, t in enumerate(prompt[1:])]

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    # -- renderings ---------------------------------------------------------------------

    def chat(self, entries: list[Entry]) -> dict[str, Any]:
        return {"content": [self._chat_entry(t, lp) for t, lp in entries if lp is not None]}

    def _chat_entry(self, token_id: int, found: TokenLogprobs) -> dict[str, Any]:
        top = [self._chat_top(t, v) for t, v in zip(found.top_ids, found.top_logprobs,
                                                     strict=True)]
        return {**self._chat_top(token_id, found.logprob), "top_logprobs": top}

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def completion_logprobs(self, entries: list[Entry]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, found in entries:
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            values.append(None if found is None else found.logprob)
            tops.append(None if found is None else self._top_map(token_id, found))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _top_map(self, token_id: int, found: TokenLogprobs) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, value in zip(found.top_ids, found.top_logprobs, strict=True):
            top.setdefault(self.text(t), value)
        top.setdefault(self.text(token_id), found.logprob)
        return top

    def choice_logprobs(self, entries: list[Entry]) -> dict[str, Any] | None:
        if not self.completion.wants_logprobs:
            return None
        if self.completion.meta.kind == responses.CHAT:
            return self.chat(entries)
        return self.completion_logprobs(entries)


def reports_logprobs(completion: Completion) -> bool:
    """Does the response need this module (logprobs or echo)?"""
    return completion.wants_logprobs or completion.echo is not None


def fill_body(body: dict[str, Any], completion: Completion, tokenizer: TextTokenizer) -> None:
    """A full body from ``responses.full_body``, with its logprobs and echo filled in."""
    if not reports_logprobs(completion):
        return
    view = LogprobsView(completion, tokenizer)
    prefix, entries = view.take()
    choice = body["choices"][0]
    choice["logprobs"] = view.choice_logprobs(entries)
    if prefix:
        choice["text"] = prefix + choice["text"]


def _chunk(view: LogprobsView, delta: TextDelta) -> bytes:
    prefix, entries = view.take()
    if prefix:
        delta = TextDelta(prefix + delta.content, delta.reasoning, delta.tool_calls)
    chunk = responses.delta_chunk(view.completion.meta, delta)
    chunk["choices"][0]["logprobs"] = view.choice_logprobs(entries)
    return sse.event(chunk)


async def stream(completion: Completion, tokenizer: TextTokenizer,
                 end: Callable[[Completion], bytes]) -> AsyncIterator[bytes]:
    """SSE like the front's plain stream, one chunk per batch of deltas, with logprobs.

    ``end``: the front's closing events (finish chunk, usage, [DONE]) or its error event.
    """
    view, meta = LogprobsView(completion, tokenizer), completion.meta
    pending = sse.event(responses.role_chunk(meta)) if meta.kind == responses.CHAT else b""
    async with aclosing(completion.batches()) as batches:
        async for deltas in batches:
            merged = TextDelta()
            for delta in deltas:
                responses.accumulate(merged, delta)
            pending += _chunk(view, merged)
            if not completion.done:
                yield pending
                pending = b""
    if view.pending:  # tokens that brought no text (EOS, a held-back stop), or the echo alone
        pending += _chunk(view, TextDelta())
    yield pending + end(completion)


def echo_of(params: CompletionParams, prompt: list[int], tokenizer: TextTokenizer) -> Echo | None:
    """A completions request's ``echo``: its prompt as sent (text), or decoded (token ids)."""
    if not params.echo:
        return None
    text = params.prompt if isinstance(params.prompt, str) else tokenizer.decode(prompt)
    return Echo(text, only=params.common.max_tokens == 0)
