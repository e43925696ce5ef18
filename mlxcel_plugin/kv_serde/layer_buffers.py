"""A received layer's buffers: sized with room for decode, and taken ahead for later layers.

Room (``room_tokens``): a plain KVCache layer's buffers hold positions past its tokens,
on a coarse grid (``room_grid``), so decode writes into what was received.

Taken ahead (``LayerStock``): each call to the engine's buffer maker is a round trip to
MLX's I/O threads from the event loop (0.1-0.2 ms each while the bulk readers run; an
8B-shaped handoff made 32), and a handoff's layers mostly share one shape. So the first
layer of a shape also takes the buffers of the later layers that may need that shape, as
far as the handoff's byte budget leaves room; those no layer took are dropped with the
handoff (``release``).
Only the engine's buffers are taken ahead: a pool's go back to it when a layer is
adopted by copying, and the next layer reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import numpy as np

from mlxcel_plugin.kv_serde.errors import OversizeDeclared
from mlxcel_plugin.kv_serde.header import (
    CHECKSUM_OF_ENCODED,
    CHECKSUM_OF_HELD,
    HandoffHeader,
    ModelFingerprint,
)
from mlxcel_plugin.kv_serde.layer_spec import LayerSpec
from mlxcel_plugin.kv_serde.messages import LayerDescriptor
from mlxcel_plugin.kv_serde.receive_memory import ReceiveMemory
from mlxcel_plugin.link.protocol.checksum import crc32_combine

BufferKey = tuple[tuple[int, ...], np.dtype]


class LayerStock:
    """``ReceiveMemory.take`` with buffers taken ahead for later layers of the same shape."""

    def __init__(self, memory: ReceiveMemory):
        self.memory = memory
        self.held_bytes = 0  # taken ahead, not yet handed out: inside the handoff's budget
        self._held: dict[BufferKey, list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype, count: int,
             ahead: Callable[[], int] = lambda: 0) -> list[np.ndarray]:
        """``count`` buffers of ``shape`` (contents undefined): those taken ahead by an earlier
        call, else fresh, with ``ahead()`` x ``count`` more kept for the next calls of this
        shape (asked only then)."""
        key = (tuple(shape), np.dtype(dtype))
        held = self._held.get(key, [])
        if len(held) >= count:
            taken, self._held[key] = held[:count], held[count:]
            self.held_bytes -= sum(buffer.nbytes for buffer in taken)
            return taken
        # A layer of another shape: what was taken ahead went unused. Dropped, so that
        # memory in hand never exceeds what the handoff's budget counts.
        self.release()
        more = ahead() if self.memory.make_buffers is not None else 0
        buffers = self.memory.take(shape, dtype, count * (1 + more))
        if len(buffers) > count:
            self._held[key] = buffers[count:]
            self.held_bytes = sum(buffer.nbytes for buffer in buffers[count:])
        return buffers[:count]

    def release(self) -> None:
        """Drop what no layer took (a finished or failed handoff's)."""
        self._held.clear()
        self.held_bytes = 0


def layer_allocation(stock: LayerStock, fp: ModelFingerprint, index: int,
                     descriptor: LayerDescriptor, header: HandoffHeader, allocated_bytes: int,
                     max_bytes: int, begun: Container[int]) -> tuple[list[np.ndarray], int]:
    """Layer ``index``'s receive buffers and the bytes they count against the handoff's
    budget: with room for decode where the budget holds it (``room_tokens``), and the
    buffers of the later layers not ``begun`` of the same spec and cache class taken
    ahead, as many as the budget holds beside what is allocated and taken already."""
    spec, kind = fp.layers[index], fp.cache_classes[index]
    size = spec.nbytes(descriptor.tokens)
    if allocated_bytes + size > max_bytes:
        raise OversizeDeclared(f"layer {index} would exceed the byte budget")
    room = room_tokens(stock.memory.room_step, header, kind, descriptor)
    if room and allocated_bytes + spec.nbytes(room) <= max_bytes:
        size = spec.nbytes(room)
    else:
        room = 0

    def ahead() -> int:
        alike = sum(1 for j in range(index + 1, fp.num_layers) if j not in begun
                    and fp.layers[j] == spec and fp.cache_classes[j] == kind)
        left = max_bytes - allocated_bytes - stock.held_bytes - size
        return max(0, min(alike, left // max(size, 1)))

    return layer_buffers(stock, spec, descriptor.tokens, room, ahead), size


def layer_buffers(stock: LayerStock, spec: LayerSpec, tokens: int,
                  room_tokens: int = 0,
                  ahead: Callable[[], int] = lambda: 0) -> list[np.ndarray]:
    """One receive buffer per array of the layer, in spec order (K and V taken together).

    ``room_tokens`` > ``tokens`` (plain K/V only): each buffer is allocated for that many
    positions and the layer's tensors are its first ``tokens`` of each head, so the
    engine's first decode steps write into the buffer the handoff landed in. Arrays of one
    shape and dtype are taken for ``ahead()`` more layers too (``LayerStock``).
    """
    if room_tokens > tokens and _has_room(spec):
        full = stock.take(spec.arrays[0].shape_for(room_tokens), spec.arrays[0].storage,
                          len(spec.arrays), ahead)
        return [buffer[:, :, :tokens, :] for buffer in full]
    shapes = [a.shape_for(tokens) for a in spec.arrays]
    if len(set(shapes)) == 1 and len({a.storage for a in spec.arrays}) == 1:
        return stock.take(shapes[0], spec.arrays[0].storage, len(shapes), ahead)
    # MLA, SSM and quantized layers: arrays of different shapes or dtypes.
    pairs = zip(spec.arrays, shapes, strict=True)
    return [stock.take(shape, a.storage, 1)[0] for a, shape in pairs]


def room_tokens(step: int, header: HandoffHeader, kind: str, descriptor: LayerDescriptor) -> int:
    """Positions to allocate a plain KVCache layer for: past its tokens, on the room grid
    (``room_grid``), so decode writes into what was received; 0: none.

    Only a full handoff whose checksums (if any) cover what was sent: raw bodies without
    (v4, AES-GCM authenticates them) or a lossy codec's bodies (``checksum_of =
    "encoded"``: combined from each body's crc as it landed). Checksums of the held bytes
    would read back each tensor, whose chunks land in per-head pieces.
    """
    if (not step or _reads_held_bytes(header) or header.prefix_tokens
            or kind != "KVCache" or descriptor.tokens != descriptor.offset):
        return 0
    return room_grid(descriptor.tokens + 1, step)


def room_grid(tokens: int, step: int) -> int:
    """The fewest positions >= ``tokens`` that are whole ``step``s on a grid of eighths of an
    octave (8k tokens: 9216; 2k: 2304): at most 1/8 more than asked, beyond the step.

    Why a grid: MLX reuses a freed buffer (warm pages) only for an allocation within two
    pages of its size, so buffers sized to the prompt's own step were reused only by
    prompts in the same 256-token step; sizes on a coarse grid are shared by every prompt
    within an eighth of an octave, and the extra positions are decode room (written in
    place) that the handoff's KV budget already counts.
    """
    steps = -(-tokens // step)
    unit = 1 << max(0, steps.bit_length() - 4)  # an eighth of the octave ``steps`` is in
    return -(-steps // unit) * unit * step


def _reads_held_bytes(header: HandoffHeader) -> bool:
    """Whether checking this handoff's checksums reads each received tensor back: checksums
    of the held bytes, or of the bodies where crcs cannot be combined (no ISA-L)."""
    return (header.checksum_of == CHECKSUM_OF_HELD
            or (header.checksum_of == CHECKSUM_OF_ENCODED and crc32_combine is None))


def _has_room(spec: LayerSpec) -> bool:
    """K and V of one shape and dtype, growing along axis 2 of four."""
    arrays = spec.arrays
    return (tuple(a.name for a in arrays) == ("k", "v") and all(a.grow_axis == 2 for a in arrays)
            and len({(a.shape, a.storage) for a in arrays}) == 1 and len(arrays[0].shape) == 4
            and arrays[0].shape[0] == 1)
