"""The text pipeline: pure, shared by the hybrid/router front and the LiteLLM provider.

Engines speak token ids; everything a client reads as text is made here.
"""

from mlxcel_plugin.text.detokenizer import IncrementalDetokenizer
from mlxcel_plugin.text.pipeline import FINISH_TOOL_CALLS, CompletionPipeline, TextDelta
from mlxcel_plugin.text.stop_strings import StopStringMatcher
from mlxcel_plugin.text.stream_filter import (
    FilterMarkers,
    Piece,
    StreamFilter,
    prompt_opens_reasoning,
)
from mlxcel_plugin.text.tokenizer import TextTokenizer
from mlxcel_plugin.text.tool_calls import ToolCall, parse_tool_call

__all__ = [
    "FINISH_TOOL_CALLS",
    "CompletionPipeline",
    "FilterMarkers",
    "IncrementalDetokenizer",
    "Piece",
    "StopStringMatcher",
    "StreamFilter",
    "TextDelta",
    "TextTokenizer",
    "ToolCall",
    "parse_tool_call",
    "prompt_opens_reasoning",
]
