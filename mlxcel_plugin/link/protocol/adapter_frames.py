"""LoRA adapters on the link: what a node holds, and the router's load/unload commands.

A node's TELEMETRY carries ``adapters`` (name -> digest of its files): what it
can run now, so the router routes an adapter's requests only to nodes holding
it at that digest (``adapter_map``). An ADAPTER frame from the router asks a
node to ``load`` (``lora_path``) or ``unload`` an adapter; the node answers
with an ADAPTER frame of the same ``command_id``: ``done`` (with the digest
loaded) or ``failed`` (with ``error``). See docs/models-and-adapters.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mlxcel_plugin.link.protocol.frame_codec import (
    Frame,
    FrameType,
    MalformedFrame,
    expect_type,
    get_field,
)

MAX_ADAPTERS = 256  # one node's announce
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
OPS = ("load", "unload", "done", "failed")


def _bounded(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise MalformedFrame(f"frame header field {name!r} must be a string of at most "
                             f"{limit} characters")  # fmt: skip
    return value


def adapter_map(header: Mapping[str, Any]) -> dict[str, str]:
    """The ``adapters`` field (name -> digest); {} when absent."""
    value = get_field(header, "adapters", dict, {})
    if len(value) > MAX_ADAPTERS:
        raise MalformedFrame(f"more than {MAX_ADAPTERS} adapters announced")
    return {_bounded("adapters", name, MAX_NAME_CHARS): _bounded("adapters", digest,
                                                                 MAX_NAME_CHARS)
            for name, digest in value.items()}  # fmt: skip


def optional_name(header: Mapping[str, Any], name: str) -> str | None:
    value = header.get(name)
    return None if value is None else _bounded(name, value, MAX_NAME_CHARS)


@dataclass(frozen=True)
class AdapterCommand:
    """Router -> node: ``load``/``unload`` an adapter; node -> router: ``done``/``failed``."""

    command_id: str
    op: str
    lora_name: str
    lora_path: str = ""  # load only
    digest: str = ""  # done: the digest the node loaded (unload: "")
    error: str = ""  # failed: why (the node's error message)
    code: str = ""  # failed: an errors.py code name

    TYPE: ClassVar[FrameType] = FrameType.ADAPTER

    def to_frame(self) -> Frame:
        header = {k: v for k, v in self.__dict__.items() if v}
        return Frame(self.TYPE, header)

    @classmethod
    def from_frame(cls, frame: Frame) -> AdapterCommand:
        expect_type(frame, cls.TYPE)
        h = frame.header
        op = get_field(h, "op", str, required=True)
        if op not in OPS:
            raise MalformedFrame(f"ADAPTER op {op!r:.40} is not one of {OPS}")
        return cls(_bounded("command_id", get_field(h, "command_id", str, required=True),
                            MAX_NAME_CHARS), op,
                   _bounded("lora_name", get_field(h, "lora_name", str, required=True),
                            MAX_NAME_CHARS),
                   _bounded("lora_path", get_field(h, "lora_path", str, ""), MAX_PATH_CHARS),
                   _bounded("digest", get_field(h, "digest", str, ""), MAX_NAME_CHARS),
                   _bounded("error", get_field(h, "error", str, ""), MAX_PATH_CHARS),
                   _bounded("code", get_field(h, "code", str, ""), MAX_NAME_CHARS))  # fmt: skip

    def reply(self, digest: str = "", error: str = "", code: str = "") -> AdapterCommand:
        """The node's answer to this command."""
        return AdapterCommand(self.command_id, "failed" if error else "done", self.lora_name,
                              digest=digest, error=error, code=code)  # fmt: skip
