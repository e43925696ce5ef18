"""What the leader rank broadcasts so every rank runs the same forwards, in the same order.

Per engine loop iteration the leader sends each command it takes (generate,
prefill, decode with the whole received K/V, cancel), then ``END`` (or
``STOP`` when the engine closes); after each prefill the first token (or
``FAILED``), after each decode step the step's tokens. A step's tokens may
say ``quiet``: the next iteration takes no commands, so sends no ``END``
(a command arriving meanwhile waits one iteration), and carry the leader's
``row_cost``: the cost of a verified row its speculation rules use next (learned
from its own timings; a follower proposing by its own would feed forwards of
other widths). Everything else a
rank does (which sequences join which group, when one ends) follows from
these, as the engine's code is the same on every rank; sampling happens only
on the leader. Messages are JSON (arrays go as collectives of their own):
the ring's peers are this node's own ranks, on a network the operator trusts
as much as the ring itself (it carries activations in the clear).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields
from typing import Any, NamedTuple

import mlx.core as mx

from engines.engine_commands import Cancel, Decode, Generate, Prefill
from engines.sharding.group import broadcast_array, broadcast_bytes
from mlxcel_plugin.engine_api import (
    CacheLayer,
    CacheState,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from mlxcel_plugin.errors import EngineError

END = b""  # the most frequent message: one collective of an empty frame
STOP = b'{"op":"stop"}'
FAILED = b'{"op":"failed"}'
Group = mx.distributed.Group


class LeaderStep(NamedTuple):
    """A step's or a prefill's tokens as a follower receives them."""

    tokens: list[int] | None  # None: the leader's own run failed
    quiet: bool = False  # the next iteration has no commands and no ``END``
    row_cost: float | None = None  # the leader's speculation row cost for the next step


class ShardDiverged(EngineError):
    """A follower saw something other than what its own state expects: the group is broken."""


def _dumps(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def _request_dict(request: GenerationRequest) -> dict[str, Any]:
    return dataclasses.asdict(request)


def _request(data: dict[str, Any]) -> GenerationRequest:
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    values["sampling"] = SamplingParams.from_dict(data["sampling"])
    return GenerationRequest(**values)


def _dtype_name(array: Any) -> str:
    return str(array.dtype).rsplit(".", 1)[-1]  # numpy "float32", MLX "mlx.core.float32"


def _layer_dict(layer: CacheLayer) -> dict[str, Any]:
    arrays = {"k": layer.keys, "v": layer.values, **layer.extra}
    specs = [{"name": n, "shape": list(a.shape), "dtype": _dtype_name(a)}
             for n, a in arrays.items() if a is not None]
    return {"kind": layer.kind, "dtype": layer.dtype, "offset": layer.offset,
            "meta": layer.meta, "extra": list(layer.extra), "arrays": specs}


def _send_arrays(group: Group, state: CacheState) -> None:
    for layer in state.layers:
        for array in (layer.keys, layer.values, *layer.extra.values()):
            if array is not None:
                broadcast_array(group, array, tuple(array.shape), array.dtype)


def _receive_layer(group: Group, data: dict[str, Any]) -> CacheLayer:
    arrays = {spec["name"]: broadcast_array(group, None, tuple(spec["shape"]),
                                            getattr(mx, spec["dtype"]))
              for spec in data["arrays"]}
    extra = {name: arrays[name] for name in data["extra"]}
    return CacheLayer(data["kind"], arrays.get("k"), arrays.get("v"), data["dtype"],
                      int(data["offset"]), dict(data["meta"]), extra)


# -- leader ---------------------------------------------------------------------------


def send_command(group: Group, command: Generate | Prefill | Decode | Cancel) -> None:
    if isinstance(command, Cancel):
        broadcast_bytes(group, _dumps({"op": "cancel", "request_id": command.request_id}))
        return
    message: dict[str, Any] = {"request": _request_dict(command.request)}
    if isinstance(command, Decode):
        message |= {"op": "decode", "first_token": command.first_token,
                    "layers": [_layer_dict(layer) for layer in command.cache.layers]}
    else:
        message["op"] = "generate" if isinstance(command, Generate) else "prefill"
    broadcast_bytes(group, _dumps(message))
    if isinstance(command, Decode):
        _send_arrays(group, command.cache)


def send_end(group: Group, going: bool) -> None:
    """After an iteration's commands: ``END``, or ``STOP`` when the engine closes."""
    broadcast_bytes(group, END if going else STOP)


def send_failed(group: Group) -> None:
    """In place of a prefill's first token: the leader's prefill raised."""
    broadcast_bytes(group, FAILED)


def send_tokens(group: Group, tokens: list[int], quiet: bool = False,
                row_cost: float | None = None) -> None:
    """A prefill's first token or a step's tokens; ``quiet``: the next iteration has no
    commands and no ``END`` (saves a collective per decode step); ``row_cost``: what the
    leader's speculation weighs a verified row at next (JSON keeps a float exactly)."""
    message: dict[str, Any] = {"op": "tokens", "tokens": tokens}
    if quiet:
        message["quiet"] = True
    if row_cost is not None:
        message["row_cost"] = row_cost
    broadcast_bytes(group, _dumps(message))


def send_config(group: Group, config: EngineConfig) -> None:
    broadcast_bytes(group, _dumps(dataclasses.asdict(config)))


# -- followers ------------------------------------------------------------------------

# What a follower rebuilds: the command's kind and arguments; callbacks are its own.
Received = tuple[str, dict[str, Any]]


def receive(group: Group) -> Received:
    """The leader's next message as (op, fields); a decode's arrays are received too."""
    payload = broadcast_bytes(group, None)
    if payload == END:
        return "end", {}
    message = json.loads(payload)
    op = message.pop("op")
    if "request" in message:
        message["request"] = _request(message["request"])
    if op == "decode":
        layers = [_receive_layer(group, layer) for layer in message.pop("layers")]
        message["cache"] = CacheState(layers)
    return op, message


def receive_step(group: Group) -> LeaderStep:
    """A step's or a prefill's tokens (None where the leader's own run failed)."""
    op, message = receive(group)
    if op == "failed":
        return LeaderStep(None)
    if op != "tokens":
        raise ShardDiverged(f"expected the leader's tokens, got {op!r}")
    return LeaderStep([int(t) for t in message["tokens"]], bool(message.get("quiet")),
                      message.get("row_cost"))


def receive_tokens(group: Group) -> list[int] | None:
    return receive_step(group).tokens


def receive_config(group: Group) -> EngineConfig:
    data = json.loads(broadcast_bytes(group, None))
    values = {}
    for field in fields(EngineConfig):
        default = field.default_factory() if callable(field.default_factory) else field.default
        value = data.get(field.name, default)
        if isinstance(value, dict) and dataclasses.is_dataclass(default):
            value = type(default)(**value)
        elif isinstance(value, list) and isinstance(default, tuple):  # JSON has no tuples
            value = tuple(value)
        values[field.name] = value
    return EngineConfig(**values)
