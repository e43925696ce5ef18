"""A DNS server on 127.0.0.1 (dnslib) whose A/AAAA records a test changes at will."""

from __future__ import annotations

import ipaddress
import threading

from dnslib import AAAA, QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

TTL_S = 1


class RecordsResolver(BaseResolver):
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}  # name (no trailing dot) -> addresses
        self.lock = threading.Lock()
        self.queries = 0

    def resolve(self, request: DNSRecord, handler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        qtype = QTYPE[request.q.qtype]
        with self.lock:
            self.queries += 1
            addresses = list(self.records.get(name, ()))
        for address in addresses:
            version = ipaddress.ip_address(address).version
            if qtype == "A" and version == 4:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=TTL_S))
            elif qtype == "AAAA" and version == 6:
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=TTL_S))
        return reply


class LocalDns:
    def __init__(self) -> None:
        self.resolver = RecordsResolver()
        quiet = DNSLogger(logf=lambda _: None)  # a line per query otherwise
        self.server = DNSServer(self.resolver, port=0, address="127.0.0.1", logger=quiet)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.server.server.server_address[1]}"

    def set(self, name: str, *addresses: str) -> None:
        with self.resolver.lock:
            self.resolver.records[name] = list(addresses)

    def __enter__(self) -> LocalDns:
        self.server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
