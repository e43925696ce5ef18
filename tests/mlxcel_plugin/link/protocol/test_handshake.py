"""Sans-I/O handshake tests: two state machines wired together in memory, no sockets."""

import random

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from mlxcel_plugin.errors import ConfigError, HandshakeError
from mlxcel_plugin.link import ClusterSecret
from mlxcel_plugin.link.protocol.handshake import ClientHandshake, ServerHandshake
from mlxcel_plugin.link.protocol.handshake_messages import (
    MSG_SERVER_HELLO,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    BadKeyShare,
    BadMac,
    MalformedHandshake,
    PeerAtCapacity,
    RoleRefused,
    UnexpectedMessage,
    VerdictKind,
    VersionMismatch,
    derive_keys,
    encode_finished,
    handshake_mac,
    parse_hello,
)

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))


def seeded(seed):
    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


def make(client_secret=SECRET, server_secret=SECRET, *, client_role="prefill",
         accept_roles=("prefill", "router"), client_kw=None, server_kw=None):
    client = ClientHandshake(client_secret, client_role, "p1", rng=seeded(1), **(client_kw or {}))
    server = ServerHandshake(server_secret, "decode", "d1", accept_roles, rng=seeded(2),
                             **(server_kw or {}))
    return client, server


def run(client, server, tamper=lambda step, msg: msg):
    """Drive both machines; ``tamper(step, msg)`` plays a man in the middle."""
    hello = tamper("client_hello", client.start())
    server_hello = tamper("server_hello", server.receive(hello))
    finished = tamper("finished", client.receive(server_hello))
    verdict = tamper("verdict", server.receive(finished))
    client.receive(verdict)
    return client.session, server.session


def test_handshake_agrees_on_keys_and_peers():
    client, server = make()
    cs, ss = run(client, server)
    assert client.done and server.done
    assert cs.peer.role == "decode" and cs.peer.node_id == "d1"
    assert ss.peer.role == "prefill" and ss.peer.node_id == "p1"
    assert ss.receiver.open(bytes(cs.sender.seal(b"c2s"))) == b"c2s"
    # The server already sent the VERDICT as record 0, so this is record 1.
    assert cs.receiver.open(bytes(ss.sender.seal(b"s2c"))) == b"s2c"


def test_hello_layout_is_stable():
    client, _ = make()
    hello = client.start()
    assert hello[:9] == b"MLXL\x01\x01\x01\x01\x00"  # magic, CLIENT_HELLO, v1.1, prefill, flags
    assert len(hello) == 4 + 5 + 32 + 32 + 1 + 2 and hello[-3:] == b"\x02p1"


def test_every_handshake_has_fresh_keys():
    k1 = run(*make())[0].keys
    c2 = ClientHandshake(SECRET, "prefill", "p1")
    s2 = ServerHandshake(SECRET, "decode", "d1", {"prefill"})
    assert run(c2, s2)[0].keys.k_c2s != k1.k_c2s


def test_wrong_secret_client_detects_server():
    client, server = make(client_secret=WRONG)
    with pytest.raises(BadMac):
        run(client, server)


def test_wrong_secret_server_detects_client():
    client, server = make(client_secret=WRONG)
    hello = client.start()
    server_hello = server.receive(hello)
    parsed, _ = parse_hello(server_hello, MSG_SERVER_HELLO)
    # A client without the secret can still compute *a* FINISHED: with its own key.
    shared = client._private.exchange(X25519PublicKey.from_public_bytes(parsed.pubkey))
    keys = derive_keys(shared, WRONG, client._random, parsed.random, hello + server_hello[:-32])
    with pytest.raises(BadMac):
        server.receive(encode_finished(handshake_mac(keys, b"client")))


def test_no_secret_is_refused():
    with pytest.raises(ConfigError):
        ClientHandshake(None, "prefill", "p1")
    with pytest.raises(ConfigError):
        ServerHandshake(None, "decode", "d1", {"prefill"})


def test_short_secret_is_refused():
    with pytest.raises(ConfigError):
        ClientHandshake(b"0123456789", "prefill", "p1")


def test_cluster_secret_object_works():
    run(*make(client_secret=ClusterSecret(SECRET), server_secret=ClusterSecret(SECRET)))


@pytest.mark.parametrize("step", ["client_hello", "server_hello", "finished", "verdict"])
def test_bit_flip_in_any_handshake_message_fails(step):
    def flip(at, msg):
        if at != step:
            return msg
        msg = bytearray(msg)
        msg[-1] ^= 0x01  # last byte: node id, MAC or tag
        return bytes(msg)

    with pytest.raises(HandshakeError):
        run(*make(), tamper=flip)


@pytest.mark.parametrize("step", ["client_hello", "server_hello"])
def test_downgraded_version_is_detected(step):
    def downgrade(at, msg):
        if at != step:
            return msg
        msg = bytearray(msg)
        msg[5] = 0  # major 1 → 0, as an attacker forcing an older protocol would
        return bytes(msg)

    with pytest.raises(BadMac):
        run(*make(), tamper=downgrade)


def test_version_mismatch_gets_an_authenticated_verdict():
    client, server = make(client_kw={"major": 2})
    with pytest.raises(VersionMismatch) as info:
        run(client, server)
    assert info.value.remote == (PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert server.verdict.kind is VerdictKind.VERSION_MISMATCH


def test_minor_versions_interoperate():
    client, server = make(client_kw={"minor": 7})
    _, ss = run(client, server)
    assert ss.peer.minor == 7


def test_wrong_role_is_refused():
    client, server = make(client_role="router", accept_roles=("prefill",))
    with pytest.raises(RoleRefused):
        run(client, server)
    assert server.verdict.kind is VerdictKind.ROLE_REFUSED


def test_client_can_insist_on_the_server_role():
    client, server = make(client_kw={"expect_roles": {"prefill"}})
    with pytest.raises(RoleRefused):
        run(client, server)


def test_at_capacity_carries_retry_after():
    client, server = make(server_kw={"at_capacity": lambda: 2.5})
    with pytest.raises(PeerAtCapacity) as info:
        run(client, server)
    assert info.value.retry_after_s == 2.5


def test_accept_extra_reaches_the_client():
    client, server = make(server_kw={"accept_extra": lambda session: {"bulk_port": 9}})
    run(client, server)
    assert client.verdict.extra == {"bulk_port": 9}


def test_messages_out_of_order_are_refused():
    client, server = make()
    with pytest.raises(UnexpectedMessage):
        server.receive(encode_finished(b"\x00" * 32))
    with pytest.raises(UnexpectedMessage):
        client.receive(b"anything")  # before start()


def test_a_failed_machine_stays_failed():
    client, server = make()
    hello = client.start()
    with pytest.raises(MalformedHandshake):
        server.receive(b"garbage")
    with pytest.raises(UnexpectedMessage):
        server.receive(hello)


def test_low_order_key_share_is_refused():
    client, server = make()
    hello = bytearray(client.start())
    hello[41:73] = bytes(32)  # all-zero X25519 point
    with pytest.raises(BadKeyShare):
        server.receive(bytes(hello))


def test_reprs_leak_no_secret_or_keys():
    client, server = make()
    cs, _ = run(client, server)
    text = repr(client) + repr(server) + repr(cs) + repr(cs.keys)
    assert SECRET.hex() not in text and cs.keys.k_c2s.hex() not in text
    assert "k_auth" not in repr(cs)
