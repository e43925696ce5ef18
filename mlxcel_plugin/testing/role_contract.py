"""The contract every serving role honours; run it on yours.

A role plugin registers ``register(name, run)`` from ``mlxcel_register_roles``;
``mlxcel-server --node-role NAME`` then calls ``run(config, registry)`` with the
``ServerConfig`` and the ``PluginRegistry``, and ``run`` serves until shutdown.
Subclass ``RoleContract`` and provide a ``role`` fixture, ``(name, run)``::

    import pytest
    from mlxcel_plugin.testing.role_contract import RoleContract

    class TestMyRole(RoleContract):
        @pytest.fixture
        def role(self):
            return "replay", run_replay

The rules, each a test below: the name is a lowercase identifier (letters,
digits, ``-`` or ``_``, starting with a letter), as a CLI value should be;
``run`` is a plain callable (not a coroutine function or generator: the CLI
calls it and returns when it does); it accepts ``(config, registry)``
positionally, with no other required parameter. A role must not start serving
on import or registration; the suite never calls ``run``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

ROLE_NAME = re.compile(r"[a-z][a-z0-9_-]*")
Role = tuple[str, Callable[..., Any]]


def check_role_name(name: object) -> None:
    assert isinstance(name, str), f"a role name is a string, got {type(name).__name__}"
    assert ROLE_NAME.fullmatch(name), f"role name {name!r} is not a lowercase identifier"


def check_role_runner(run: object) -> None:
    """``run`` is a synchronous callable taking ``(config, registry)`` positionally."""
    assert callable(run), f"a role registers a callable, got {type(run).__name__}"
    unwrapped = inspect.unwrap(run)
    assert not inspect.iscoroutinefunction(unwrapped), "run must block, not return a coroutine"
    assert not inspect.isasyncgenfunction(unwrapped), "run must block, not be an async generator"
    assert not inspect.isgeneratorfunction(unwrapped), "run must block, not be a generator"
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):  # a builtin without a signature: nothing more to check
        return
    try:
        signature.bind(object(), object())
    except TypeError as exc:
        raise AssertionError(f"run({signature}) cannot be called as run(config, registry)") from exc


class RoleContract:
    @pytest.fixture
    def role(self) -> Role:
        raise NotImplementedError("provide a `role` fixture: (name, run)")

    def test_name_is_a_lowercase_identifier(self, role: Role) -> None:
        check_role_name(role[0])

    def test_run_is_a_blocking_callable_of_config_and_registry(self, role: Role) -> None:
        check_role_runner(role[1])
