"""``ForkedNode.wait``: a timeout says where the node (and the forkserver) stand.

Starting real nodes from the forkserver is what every cluster fixture does
(tests/conftest.py); here a plain child stands in for a node.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import subprocess
import time

import pytest

from mlxcel_plugin.node_forkserver import (
    ForkedNode,
    NodeWaitTimeout,
    _process_state,
    process_state,
)


@pytest.fixture
def sleeping_node():
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    node = ForkedNode(process, ["sleep", "60"])
    yield node
    if node.poll() is None:
        node.kill()
        node.wait(30)


def test_a_wait_that_times_out_names_the_node_s_state(sleeping_node):
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        sleeping_node.wait(0.2)
    assert isinstance(raised.value, NodeWaitTimeout)
    state = re.search(rf"node {sleeping_node.pid} ([A-Z]) ", str(raised.value))
    assert state and state.group(1) not in "ZX"  # running or asleep: not ended
    assert "forkserver" in str(raised.value)


def test_a_killed_node_is_reported_ended(sleeping_node):
    sleeping_node.kill()
    assert sleeping_node.wait(30) == -signal.SIGKILL
    assert _process_state(sleeping_node.pid).endswith(" gone")  # reaped: no /proc entry
    assert process_state(sleeping_node.pid) is None
