"""KV conversions across a handoff (kv_serde/convert.py): bytes in, bytes out.

Widening is exact; narrowing rounds to nearest even; a cast sender's handoff
assembles on a receiver of that dtype unchanged; a narrower sender's handoff
is taken by a wider receiver in the sender's form (the engine widens it); what
never converts (layers, heads, packed words in another dtype) stays refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import from_float32, to_float32
from mlxcel_plugin.kv_serde import HandoffHeader, KVAssembler
from mlxcel_plugin.kv_serde.convert import (
    UNQUANTIZED,
    Arrival,
    CastingStrategy,
    cast_array,
    cast_fingerprint,
    cast_layer,
    casting,
    converts,
    receiving_forms,
    wire_dtype,
)
from mlxcel_plugin.testing.caches import (
    make_cache,
    make_fingerprint,
    make_header,
    mixed_fingerprint,
)
from mlxcel_plugin.transfer import FullTransfer, StrategyOptions, StreamedTransfer

TOKENS = 37


def test_widening_is_exact_and_narrowing_rounds_to_nearest_even() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(4096).astype(np.float32) * 7
    for dtype in ("float16", "bfloat16"):
        narrow = from_float32(values, dtype)
        wide = cast_array(narrow, dtype, "float32")
        assert wide.dtype == np.float32
        assert np.array_equal(cast_array(wide, "float32", dtype), narrow)  # back: same bits
        assert np.array_equal(wide, to_float32(narrow, dtype))
    assert np.array_equal(cast_array(values, "float32", "float16"), values.astype(np.float16))
    # bfloat16: 1 + 2**-8 is halfway between 1 and 1 + 2**-7: ties go to the even one (1.0).
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    assert cast_array(halfway, "float32", "bfloat16").tolist() == [0x3F80, 0x3F82]
    f16 = from_float32(values, "float16")
    assert np.array_equal(cast_array(f16, "float16", "bfloat16"),
                          from_float32(f16.astype(np.float32), "bfloat16"))


def test_the_wire_carries_the_narrower_dtype() -> None:
    assert wire_dtype("float32", "float16") == "float16"
    assert wire_dtype("float32", "bfloat16") == "bfloat16"
    assert wire_dtype("float16", "float32") == "float16"  # the receiver widens on arrival
    assert wire_dtype("bfloat16", "float16") == "float16"  # same size: the sender casts
    assert wire_dtype("float16", "float16") == "float16"


def test_a_cast_layer_and_fingerprint_describe_each_other() -> None:
    fp = make_fingerprint(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
    layer = make_cache(fp, TOKENS).layers[0]
    cast = cast_layer(layer, "float16")
    assert cast.dtype == "float16" and cast.keys.dtype == np.float16
    assert np.array_equal(cast.values, layer.values.astype(np.float16))
    described = cast_fingerprint(fp, "float16")
    assert described.dtype == "float16"
    assert {a.dtype for spec in described.layers for a in spec.arrays} == {"float16"}
    mixed = cast_fingerprint(mixed_fingerprint("float16"), "float32")
    quant = mixed.layers[2]
    assert quant == mixed_fingerprint("float16").layers[2]  # packed words are never cast
    assert mixed.layers[1].arrays[0].dtype == "float32"


def _send(fp, cache, strategy, header_fp=None):
    header = make_header(header_fp or fp, TOKENS)
    messages = list(strategy.start(header))
    for index, layer in enumerate(cache.layers):
        messages += strategy.add_layer(index, layer)
    return messages + strategy.finish()


def _receive(messages, arrival: Arrival):
    """Assemble as a decode node does: against what ``arrival`` takes the sent K/V as."""
    sent = HandoffHeader.from_message(messages[0]).fingerprint
    assembler = KVAssembler(arrival.fingerprint_for(sent), builtin_codecs())
    result = None
    for message in messages:
        result = assembler.feed(message) or result
    return sent, result


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_wider_sender_casts_before_sending(target: str) -> None:
    fp32 = make_fingerprint(num_layers=3, kv_heads=2, head_dim=16, dtype="float32")
    cache = make_cache(fp32, TOKENS, seed=3)
    strategy = casting(FullTransfer(StrategyOptions(chunk_bytes=512)), "float32", target)
    assert isinstance(strategy, CastingStrategy)
    received_fp = cast_fingerprint(fp32, target)
    sent, result = _receive(_send(fp32, cache, strategy), Arrival(received_fp))
    assert sent.dtype == target and converts(sent, received_fp) == ""
    for got, want in zip(result.cache.layers, cache.layers, strict=True):
        assert got.dtype == target
        assert np.array_equal(got.keys, cast_array(want.keys, "float32", target))
        assert np.array_equal(got.values, cast_array(want.values, "float32", target))


def test_a_narrower_sender_is_taken_in_its_own_form_and_widened_exactly() -> None:
    fp16 = make_fingerprint(num_layers=2, kv_heads=2, head_dim=16, dtype="float16")
    cache = make_cache(fp16, TOKENS, seed=4)
    strategy = casting(StreamedTransfer(StrategyOptions()), "float16", "float16")
    local = cast_fingerprint(fp16, "float32")
    sent, result = _receive(_send(fp16, cache, strategy), Arrival(local))
    assert converts(sent, local) == "float16->float32"
    for got, want in zip(result.cache.layers, cache.layers, strict=True):
        assert got.dtype == "float16" and np.array_equal(got.keys, want.keys)
        wide = cast_layer(got, "float32")  # what the engine does (in MLX) before decoding
        assert np.array_equal(cast_array(wide.keys, "float32", "float16"), want.keys)


def test_plain_kv_arrives_at_a_quantizing_receiver_in_its_plain_form() -> None:
    plain = make_fingerprint(num_layers=2, kv_heads=2, head_dim=32, dtype="float16")
    quant = mixed_fingerprint("float16").layers[2]
    engine_fp = {**dataclasses.replace(plain, cache_classes=("QuantizedKVCache",) * 2,
                                       layers=(quant, quant), kv_heads=0, head_dim=0).to_dict(),
                 UNQUANTIZED: {"kv_heads": 2, "head_dim": 32, "cache_classes": ["KVCache"] * 2,
                               "layers": [layer.to_dict() for layer in plain.layers]}}
    local, plain_form = receiving_forms(engine_fp)
    assert plain_form is not None and plain_form.layers == plain.layers
    arrival = Arrival(local, plain_form)
    assert arrival.fingerprint_for(plain) == plain
    assert converts(plain, local) == "quantize"
    wider = cast_fingerprint(plain, "float32")  # a float32 plain sender: cast, then quantized
    assert arrival.fingerprint_for(wider) == wider
    assert converts(wider, local) == "float32->float16+quantize"
    assert arrival.fingerprint_for(local) == local  # a quantizing sender of the same bits


def test_what_never_converts_stays_refused() -> None:
    local = make_fingerprint(num_layers=2, kv_heads=2, head_dim=16, dtype="float32")
    arrival = Arrival(local)
    for other in (make_fingerprint(num_layers=3, kv_heads=2, head_dim=16, dtype="float16"),
                  make_fingerprint(num_layers=2, kv_heads=4, head_dim=16, dtype="float16"),
                  make_fingerprint(num_layers=2, kv_heads=2, head_dim=8, dtype="float32"),
                  make_fingerprint(num_layers=2, kv_heads=2, head_dim=16, dtype="float16",
                                   kinds=["RotatingKVCache"] * 2)):
        with pytest.raises(HandoffError):
            arrival.fingerprint_for(other)
    packed = mixed_fingerprint("float16")  # quantized K/V in another dtype: never re-cast
    with pytest.raises(HandoffError):
        Arrival(cast_fingerprint(packed, "float32")).fingerprint_for(packed)


def test_a_quantized_layer_is_never_cast() -> None:
    layer = CacheLayer.of_arrays("QuantizedKVCache", {"k": np.zeros((1, 2, 3, 8), np.uint32)},
                                 "float16", 3)
    assert cast_layer(layer, "float32") is layer
