"""A linear layer with several LoRA adapters, each batch row using its own (or none).

The adapters of one layer are stacked into ``a`` (S, in, r) and ``b`` (S, r, out)
with a scale per slot; slot 0 is the base (zeros, scale 0). Before each forward
the engine says which slot each batch row uses (``AdapterRows``); the layer
gathers each row's A and B and adds ``scale * (x @ A) @ B`` per row in one batched
matmul. So base and adapted sequences decode together in one batch, without
fusing any adapter into the weights and without splitting the batch. Ranks
differ between adapters: each slot is zero-padded to the largest (zeros add
nothing). A batch of base rows alone skips the LoRA products entirely.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engines.lora.files import LoraWeights

BASE_SLOT = 0


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(input, output) dims of a plain or quantized linear layer."""
    out_dims, in_dims = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dims = in_dims * 32 // module.bits
    return in_dims, out_dims


class AdapterRows:
    """Which slot each row of the next forward uses; shared by every adapted layer."""

    def __init__(self) -> None:
        self.slots: mx.array | None = None  # (B,) int32; None: every row is the base

    def set(self, slots: list[int]) -> None:
        self.slots = None if not any(slots) else mx.array(slots, dtype=mx.int32)


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rows: AdapterRows, in_dims: int, out_dims: int):
        super().__init__()
        self.base = base
        self._rows = rows
        self._dims = (in_dims, out_dims)
        self._slots: dict[int, tuple[LoraWeights, float]] = {}
        self._stack: tuple[mx.array, mx.array, mx.array] | None = None

    def put(self, slot: int, weights: LoraWeights, scale: float) -> None:
        if weights.a.shape[0] != self._dims[0] or weights.b.shape[1] != self._dims[1]:
            raise ValueError(f"adapter shapes {weights.a.shape}/{weights.b.shape} do not fit "
                             f"a {self._dims[0]}->{self._dims[1]} layer")  # fmt: skip
        self._slots[slot] = (weights, scale)
        self._restack()

    def drop(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self._restack()

    def _restack(self) -> None:
        if not self._slots:
            self._stack = None
            return
        count = max(self._slots) + 1
        rank = max(w.a.shape[1] for w, _ in self._slots.values())
        in_dims, out_dims = self._dims
        dtype = self.base.weight.dtype if "weight" in self.base else mx.float32
        a = mx.zeros((count, in_dims, rank), dtype=dtype)
        b = mx.zeros((count, rank, out_dims), dtype=dtype)
        scales = [0.0] * count
        for slot, (w, scale) in self._slots.items():
            r = w.a.shape[1]
            a[slot, :, :r] = w.a.astype(dtype)
            b[slot, :r, :] = w.b.astype(dtype)
            scales[slot] = scale
        self._stack = (a, b, mx.array(scales, dtype=dtype))
        mx.eval(*self._stack)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self._rows.slots
        if slots is None or self._stack is None:
            return y
        a, b, scales = self._stack
        # A slot past this layer's stack adapts other layers only: the base's zeros here.
        slots = mx.where(slots < a.shape[0], slots, BASE_SLOT)
        z = (x @ a[slots]) @ b[slots]  # (B, L, in) @ (B, in, r) @ (B, r, out): per row
        return y + (scales[slots][:, None, None] * z).astype(x.dtype)
