"""``file``: ``--peers-file PATH``, re-read when it changes (mtime, every ``interval_s``)
and at once on SIGHUP.

The file is TOML with ``prefill`` and ``decode`` lists; an entry is ``"host:port"``
or ``{ address = "host:port", fingerprint = "...", model = "NAME" }`` (with a
``model``, only that model's pool takes it: ``served_model.py``). A file that is missing or
does not parse keeps the last good membership (an editor's half-written save must
not drain the cluster), with one log line per bad version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import (
    NODE_ROLES,
    DiscoveryConfig,
    Member,
    Snapshot,
    pinned_profile,
)
from mlxcel_plugin.errors import ConfigError
from router_plugin.discovery.served_model import MODEL_KEY, belongs, pool_model

logger = logging.getLogger(__name__)

FileVersion = tuple[int, int] | None  # (mtime_ns, size); None: missing


def parse_peers_file(text: str, source: str = "file", model: str | None = None) -> Snapshot:
    """The members a peers file lists for the pool of ``model`` (None: all); ConfigError
    naming what is wrong."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}") from exc
    unknown = sorted(set(document) - set(NODE_ROLES))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; known: prefill, decode")
    return frozenset(_members(document, source, model))


def _members(document: dict[str, Any], source: str, model: str | None) -> Iterator[Member]:
    for role in NODE_ROLES:
        entries = document.get(role, [])
        if not isinstance(entries, list):
            raise ConfigError(f"{role} must be a list of addresses")
        for entry in entries:
            if not isinstance(entry, dict) or belongs(entry.get(MODEL_KEY), model):
                yield _member(role, entry, source)


def _member(role: str, entry: Any, source: str) -> Member:
    if isinstance(entry, str):
        entry = {"address": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("address"), str):
        raise ConfigError(f"{role} entry {entry!r} is neither 'host:port' nor {{address=...}}")
    try:
        return Member(role, entry["address"].strip(), entry.get("fingerprint"), source,
                      pinned_profile(entry))
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"{role} entry {entry['address']!r}: {exc}") from exc


def file_version(path: Path) -> FileVersion:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


class PeersFileSource:
    name = "file"

    def __init__(self, config: ServerConfig, discovery: DiscoveryConfig):
        if not config.peers_file:
            raise ConfigError("the file discovery source needs --peers-file PATH")
        self.path = Path(config.peers_file)
        self.model = pool_model(config)
        self.interval_s = discovery.interval_s
        self._wake = asyncio.Event()

    def reload(self) -> None:
        """Look at the file now (SIGHUP), changed or not."""
        self._wake.set()

    async def watch(self) -> AsyncIterator[Snapshot]:
        last: Snapshot | None = None
        seen: FileVersion | bool = False  # False: not looked at yet
        with self._on_sighup():
            while True:  # until aclose()
                version = file_version(self.path)
                if version != seen or self._wake.is_set():
                    seen = version
                    members = self._read(version, last)
                    if members != last:
                        last = members
                        yield members
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._wake.wait()

    def _read(self, version: FileVersion, last: Snapshot | None) -> Snapshot:
        if version is None:
            logger.warning("--peers-file %s: missing; keeping the nodes it last listed",
                           self.path)
            return frozenset() if last is None else last
        try:
            return parse_peers_file(self.path.read_text(encoding="utf-8"), self.name, self.model)
        except (OSError, ConfigError) as exc:
            logger.error("--peers-file %s: %s; keeping the nodes it last listed", self.path, exc)
            return frozenset() if last is None else last

    @contextlib.contextmanager
    def _on_sighup(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (ValueError, RuntimeError, NotImplementedError, AttributeError):
            logger.debug("no SIGHUP handler here (not the main thread); mtime polling only")
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
