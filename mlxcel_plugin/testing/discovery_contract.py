"""The contract every discovery source honours; run it on yours.

A discovery plugin registers ``register(name, factory)`` from
``mlxcel_register_discovery``; the router builds ``factory(config, discovery)``
and iterates ``source.watch()``. Subclass ``DiscoveryContract`` and provide a
``case`` fixture: ``(name, source, expected)``, where ``source`` is built for a
hermetic test (a temp file, a local DNS server, a fake API) and ``expected`` is
the set of ``(role, address)`` its snapshots should reach (None: any)::

    import pytest
    from mlxcel_plugin.testing.discovery_contract import DiscoveryContract

    class TestMySource(DiscoveryContract):
        @pytest.fixture
        def case(self):
            return "consul", ConsulSource(config, discovery), {("decode", "10.0.0.2:9000")}

The rules, each a test below: ``source.name`` is the registered name, a
lowercase identifier; ``watch()`` is an async iterator whose first snapshot
comes promptly (an empty one is fine); every snapshot is a ``frozenset`` of
``Member`` with a known role; the snapshots reach ``expected``; and closing the
iterator (``aclose``) returns promptly, leaving nothing running.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mlxcel_plugin.discovery_api import NODE_ROLES, Member

SOURCE_NAME = re.compile(r"[a-z][a-z0-9_-]*")
FIRST_SNAPSHOT_S = 10.0
EXPECTED_S = 15.0
CLOSE_S = 10.0
Case = tuple[str, Any, "set[tuple[str, str]] | None"]


def check_snapshot(snapshot: object) -> None:
    assert isinstance(snapshot, frozenset), f"a snapshot is a frozenset, got {type(snapshot)}"
    for member in snapshot:
        assert isinstance(member, Member), f"a snapshot holds Members, got {type(member)}"
        assert member.role in NODE_ROLES, f"unknown role {member.role!r}"


async def first_snapshot(watch: AsyncIterator[Any]) -> Any:
    return await asyncio.wait_for(anext(watch), FIRST_SNAPSHOT_S)


async def reach(watch: AsyncIterator[Any], expected: set[tuple[str, str]], snapshot: Any) -> Any:
    """The first snapshot (from ``snapshot`` on) whose keys are ``expected``."""
    async with asyncio.timeout(EXPECTED_S):
        while {member.key for member in snapshot} != expected:
            snapshot = await anext(watch)
            check_snapshot(snapshot)
    return snapshot


class DiscoveryContract:
    @pytest.fixture
    def case(self) -> Case:
        raise NotImplementedError("provide a `case` fixture: (name, source, expected)")

    def test_name_is_the_registered_lowercase_identifier(self, case: Case) -> None:
        name, source, _ = case
        assert SOURCE_NAME.fullmatch(name), f"source name {name!r} is not a lowercase identifier"
        assert source.name == name, f"source.name {source.name!r} is not its name {name!r}"

    def test_watch_yields_member_snapshots_reaching_the_expected_set(self, case: Case) -> None:
        _, source, expected = case

        async def scenario() -> None:
            watch = source.watch()
            assert hasattr(watch, "__anext__"), "watch() returns an async iterator"
            try:
                snapshot = await first_snapshot(watch)
                check_snapshot(snapshot)
                if expected is not None:
                    await reach(watch, expected, snapshot)
            finally:
                await asyncio.wait_for(watch.aclose(), CLOSE_S)

        asyncio.run(scenario())

    def test_closing_the_watch_is_prompt_and_leaves_no_task(self, case: Case) -> None:
        _, source, _ = case

        async def scenario() -> None:
            watch = source.watch()
            await first_snapshot(watch)
            await asyncio.wait_for(watch.aclose(), CLOSE_S)
            others = asyncio.all_tasks() - {asyncio.current_task()}
            assert not others, f"tasks left running after aclose(): {others}"

        asyncio.run(scenario())
