"""The contract every KV codec honours; run it on yours.

Subclass ``CodecContract`` in a test module and provide a ``codec`` fixture::

    import pytest
    from mlxcel_plugin.testing.codec_contract import CodecContract

    class TestMyCodec(CodecContract):
        @pytest.fixture
        def codec(self):
            return MyCodec()

Lossless codecs must round-trip bit-exactly (NaN payloads included); lossy
ones must stay within ``profile.relative_error`` of the larger of the row's and
the column's max |x| (a group lies along one of them), with or without a
``ChunkLayout``. Every refusal of bad input must be a ``HandoffError``.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import (
    TENSOR_DTYPES,
    ChunkLayout,
    CodecProfile,
    KVCodec,
    to_float32,
)
from mlxcel_plugin.testing.caches import make_tensor

SHAPES = [(1, 64), (7, 128), (300, 64), (5, 80)]
# (tensor, tokens per head, first row) as a function of the chunk's rows: none; a
# whole single head; a chunk that starts mid-head and spans head boundaries.
LAYOUTS = {
    "none": lambda rows: None,
    "k-one-head": lambda rows: ChunkLayout("k", rows, 0),
    "k-mid-head": lambda rows: ChunkLayout("k", max(rows // 2, 1) + 2, rows + 3),
    "v-mid-head": lambda rows: ChunkLayout("v", max(rows // 3, 1) + 1, rows + 1),
}


def _chunk(dtype: str, shape: tuple[int, int], seed: int = 0, smooth: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return make_tensor(rng, (1, 1, *shape), dtype, smooth).reshape(shape)


def _wire_meta(meta: dict) -> dict:
    """The meta as the receiver sees it: after a msgpack round trip."""
    return msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)


def _check_close(codec: KVCodec, decoded: np.ndarray, array: np.ndarray, dtype: str) -> None:
    if codec.lossless:
        assert decoded.tobytes() == array.tobytes()
        return
    got, want = to_float32(decoded, dtype), to_float32(array, dtype)
    magnitude = np.abs(want)
    group_max = np.maximum(magnitude.max(axis=-1, keepdims=True), magnitude.max(axis=0))
    assert np.all(np.abs(got - want) <= codec.profile.relative_error * group_max + 1e-30)


class CodecContract:
    @pytest.fixture
    def codec(self) -> KVCodec:
        raise NotImplementedError("provide a `codec` fixture")

    def test_declares_its_nature(self, codec):
        assert isinstance(codec.name, str) and codec.name
        assert isinstance(codec.lossless, bool)
        assert isinstance(codec.profile, CodecProfile)
        assert codec.profile.ratio > 0
        assert (codec.profile.relative_error == 0) == codec.lossless

    @pytest.mark.parametrize("dtype", TENSOR_DTYPES)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    @pytest.mark.parametrize("smooth", [False, True], ids=["noise", "smooth"])
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_round_trip(self, codec, dtype, shape, smooth, layout):
        array = _chunk(dtype, shape, smooth=smooth)
        body, meta = codec.encode(array, dtype, LAYOUTS[layout](shape[0]))
        decoded = codec.decode(bytes(body), _wire_meta(meta), shape, dtype)
        assert decoded.shape == shape and decoded.dtype == array.dtype
        _check_close(codec, decoded, array, dtype)

    def test_lossless_keeps_every_bit_pattern(self, codec):
        if not codec.lossless:
            pytest.skip("lossy codec")
        bits = np.random.default_rng(1).integers(0, 1 << 16, (16, 64), dtype=np.uint16)
        for dtype, array in (("bfloat16", bits), ("float16", bits.view("<f2"))):
            body, meta = codec.encode(array, dtype)
            decoded = codec.decode(body, _wire_meta(meta), array.shape, dtype)
            assert decoded.tobytes() == array.tobytes()

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_does_not_modify_input(self, codec, layout):
        array = _chunk("float16", (8, 64))
        before = array.copy()
        codec.encode(array, "float16", LAYOUTS[layout](8))
        assert array.tobytes() == before.tobytes()

    def test_accepts_a_memoryview_body(self, codec):
        array = _chunk("float32", (4, 64))
        body, meta = codec.encode(array, "float32")
        decoded = codec.decode(memoryview(bytes(body)), meta, array.shape, "float32")
        _check_close(codec, decoded, array, "float32")

    @pytest.mark.parametrize("cut", [1, 2, 7])
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_refuses_a_short_body(self, codec, cut, layout):
        array = _chunk("float16", (16, 64))
        body, meta = codec.encode(array, "float16", LAYOUTS[layout](16))
        with pytest.raises(HandoffError):
            codec.decode(bytes(body)[:-cut], meta, array.shape, "float16")

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_refuses_a_long_body(self, codec, layout):
        array = _chunk("float16", (16, 64))
        body, meta = codec.encode(array, "float16", LAYOUTS[layout](16))
        with pytest.raises(HandoffError):
            codec.decode(bytes(body) + b"\0" * 3, meta, array.shape, "float16")

    @pytest.mark.parametrize(
        "meta",
        [
            {},
            {"c": "yes"},
            {"g": -1},
            {"s": 1, "n": "x"},
            {"g": 10**12},
            {"g": 64, "a": "t"},
            {"g": 4, "a": "t", "t": 8, "r": 9, "x": 1},
            {"g": 4, "a": "t", "t": 2**40, "r": 0, "x": 0},
            {"g": 64, "t": 16, "r": 0, "x": -1},
        ],
        ids=str,
    )
    def test_bad_meta_is_refused_or_ignored(self, codec, meta):
        array = _chunk("float16", (16, 64))
        body, _ = codec.encode(array, "float16")
        try:
            decoded = codec.decode(body, meta, array.shape, "float16")
        except HandoffError:
            return
        assert decoded.shape == array.shape and decoded.dtype == array.dtype

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_garbage_body_is_refused_or_decoded_to_shape(self, codec, layout):
        array = _chunk("float16", (16, 64))
        body, meta = codec.encode(array, "float16", LAYOUTS[layout](16))
        garbage = np.random.default_rng(2).bytes(len(body))
        try:
            decoded = codec.decode(garbage, meta, array.shape, "float16")
        except HandoffError:
            return
        assert decoded.shape == array.shape and decoded.dtype == array.dtype
