import pytest

from mlxcel_plugin.link.protocol.records import (
    RecordAuthError,
    RecordError,
    RecordReceiver,
    RecordSender,
    RecordStateError,
    RecordTooLarge,
    RecordTruncated,
)

KEY, IV, LABEL = bytes(range(32)), b"\x01\x02\x03\x04", b"test c2s"


def pair(max_record_bytes=1024):
    return (RecordSender(KEY, IV, LABEL, max_record_bytes),
            RecordReceiver(KEY, IV, LABEL, max_record_bytes))


def sealed(sender, *plaintexts):
    return [bytes(sender.seal(p)) for p in plaintexts]


def test_round_trip_in_order():
    tx, rx = pair()
    for i, record in enumerate(sealed(tx, b"a", b"", b"ccc")):
        assert rx.open(record) == [b"a", b"", b"ccc"][i]
    assert tx.seq == rx.seq == 3


def test_seal_reuses_its_buffer_without_corrupting_earlier_copies():
    tx, rx = pair()
    first = bytes(tx.seal(b"x" * 100))
    second = bytes(tx.seal(b"y" * 10))
    assert rx.open(first) == b"x" * 100 and rx.open(second) == b"y" * 10


@pytest.mark.parametrize("bit", [0, 7, 8 * 5 + 3, 8 * 20])  # ciphertext bytes and tag bytes
def test_bit_flip_anywhere_fails(bit):
    tx, rx = pair()
    record = bytearray(sealed(tx, b"0123456789abcdef")[0])
    record[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(RecordAuthError):
        rx.open(bytes(record))


def test_replayed_record_fails():
    tx, rx = pair()
    first, _ = sealed(tx, b"one", b"two")
    rx.open(first)
    with pytest.raises(RecordAuthError):
        rx.open(first)


def test_reordered_records_fail():
    tx, rx = pair()
    first, second = sealed(tx, b"one", b"two")
    with pytest.raises(RecordAuthError):
        rx.open(second)


def test_dropped_record_fails():
    tx, rx = pair()
    first, _, third = sealed(tx, b"one", b"two", b"three")
    rx.open(first)
    with pytest.raises(RecordAuthError):
        rx.open(third)


def test_truncated_record_fails():
    tx, rx = pair()
    record = sealed(tx, b"some plaintext")[0]
    with pytest.raises(RecordAuthError):
        rx.open(record[:-1])
    tx2, rx2 = pair()
    with pytest.raises(RecordTruncated):
        rx2.open(sealed(tx2, b"x")[0][:15])


def test_oversized_record_is_refused_both_ways():
    tx, rx = pair(max_record_bytes=64)
    with pytest.raises(RecordTooLarge):
        tx.seal(b"x" * 65)
    with pytest.raises(RecordTooLarge):
        rx.open(b"\x00" * (65 + 16))


def test_wrong_key_or_direction_label_fails():
    tx = RecordSender(KEY, IV, b"test s2c")
    with pytest.raises(RecordAuthError):
        RecordReceiver(KEY, IV, LABEL).open(bytes(tx.seal(b"hi")))


def test_failure_poisons_the_receiver():
    tx, rx = pair()
    good = sealed(tx, b"ok")[0]
    with pytest.raises(RecordAuthError):
        rx.open(b"\x00" * 20)
    with pytest.raises(RecordStateError):
        rx.open(good)
    assert issubclass(RecordStateError, RecordError)


def test_open_into_preallocated_buffer():
    tx, rx = pair()
    out = bytearray(64)
    n = rx.open_into(sealed(tx, b"hello")[0], out)
    assert out[:n] == b"hello"


@pytest.mark.parametrize("cuts", [(5,), (1, 4), (0, 2, 0, 3), (3, 1, 1)])
def test_a_record_sealed_from_parts_equals_one_sealed_whole_and_opens_into_parts(cuts):
    plain = b"hello"
    views, at = [], 0
    for n in cuts:
        views.append(memoryview(plain)[at : at + n])
        at += n
    whole, _ = pair()
    record = bytearray(64)
    n = pair()[0].seal_parts_into(views, record)
    assert bytes(record[:n]) == bytes(whole.seal(plain))
    outs = [bytearray(len(v)) for v in views]
    rx = pair()[1]
    assert rx.open_parts_into(memoryview(record)[:n], [memoryview(o) for o in outs]) == 5
    assert b"".join(outs) == plain and rx.seq == 1


def test_a_tampered_record_opened_into_parts_fails_and_poisons():
    tx, rx = pair()
    record = bytearray(sealed(tx, b"abcdef")[0])
    record[2] ^= 1
    outs = [memoryview(bytearray(3)), memoryview(bytearray(3))]
    with pytest.raises(RecordAuthError):
        rx.open_parts_into(memoryview(record), outs)
    with pytest.raises(RecordStateError):
        rx.open_parts_into(memoryview(record), outs)


def test_parts_that_do_not_add_up_are_refused():
    tx, rx = pair(max_record_bytes=8)
    with pytest.raises(RecordTooLarge):
        tx.seal_parts_into([memoryview(b"12345"), memoryview(b"6789")], bytearray(64))
    record = memoryview(sealed(tx, b"abc")[0])
    with pytest.raises(RecordError):
        rx.open_parts_into(record, [memoryview(bytearray(1)), memoryview(bytearray(1))])
