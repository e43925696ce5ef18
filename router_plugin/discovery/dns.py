"""``dns``: ``dns:NAME:PORT`` entries of ``--prefill-peers`` / ``--decode-peers``.

Every A and AAAA record of NAME is a node at ``ADDRESS:PORT`` (a Kubernetes
headless Service has one record per ready pod); names are resolved again every
``[discovery] interval_s``. A name that does not exist (or has no records)
holds no node; a lookup that fails (timeout, no server) keeps the addresses the
name had, so a resolver blip never drains the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.resolver

from mlxcel_plugin.config import ServerConfig, parse_host_port
from mlxcel_plugin.discovery_api import (
    DiscoveryConfig,
    Member,
    Snapshot,
    host_port,
    is_dns_entry,
    parse_dns_entry,
)

logger = logging.getLogger(__name__)

RECORD_TYPES = ("A", "AAAA")
LOOKUP_TIMEOUT_S = 2.0
Lookup = Callable[[str], Coroutine[Any, Any, list[str]]]  # name -> addresses; raises on failure


class LookupFailed(Exception):
    """The resolver gave no verdict on a name (as opposed to: the name has no records)."""


@dataclass(frozen=True)
class DnsEntry:
    role: str
    name: str
    port: int


def dns_entries(config: ServerConfig) -> list[DnsEntry]:
    pools = (("prefill", config.prefill_peers), ("decode", config.decode_peers))
    return [DnsEntry(role, *parse_dns_entry(entry))
            for role, entries in pools for entry in entries if is_dns_entry(entry)]


def make_resolver(nameservers: tuple[str, ...]) -> dns.asyncresolver.Resolver:
    """The system's resolver, or one asking only ``nameservers`` (host:port, one port)."""
    if not nameservers:
        return dns.asyncresolver.Resolver()
    resolver = dns.asyncresolver.Resolver(configure=False)
    servers = [parse_host_port(server) for server in nameservers]
    resolver.nameservers = [host for host, _ in servers]
    resolver.port = servers[0][1]
    return resolver


def make_lookup(resolver: dns.asyncresolver.Resolver) -> Lookup:
    async def lookup(name: str) -> list[str]:
        addresses: list[str] = []
        for record_type in RECORD_TYPES:
            try:
                # search: a short Service name gets resolv.conf's search domains, as in a pod.
                answer = await resolver.resolve(name, record_type, lifetime=LOOKUP_TIMEOUT_S,
                                                search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                raise LookupFailed(f"{type(exc).__name__}: {exc}") from exc
            addresses += [record.to_text() for record in answer]
        return sorted(addresses)

    return lookup


class DnsSource:
    name = "dns"

    def __init__(self, config: ServerConfig, discovery: DiscoveryConfig,
                 lookup: Lookup | None = None):
        self.entries = dns_entries(config)
        self.interval_s = discovery.interval_s
        self._nameservers = discovery.nameservers
        self._lookup = lookup
        self._known: dict[str, list[str]] = {}  # name -> addresses at the last good lookup

    async def watch(self) -> AsyncIterator[Snapshot]:
        lookup = self._lookup or make_lookup(make_resolver(self._nameservers))
        last: Snapshot | None = None
        while True:  # until aclose()
            members = await self.resolve_once(lookup)
            if members != last:
                last = members
                yield members
            await asyncio.sleep(self.interval_s)

    async def resolve_once(self, lookup: Lookup) -> Snapshot:
        names = sorted({entry.name for entry in self.entries})
        results = await asyncio.gather(*(lookup(name) for name in names), return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, LookupFailed):
                logger.warning("dns: lookup of %s failed (%s); keeping its last addresses",
                               name, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._known[name] = result
        return frozenset(Member(entry.role, host_port(address, entry.port), source=self.name)
                         for entry in self.entries for address in self._known.get(entry.name, ()))
