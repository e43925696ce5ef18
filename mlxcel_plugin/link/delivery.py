"""Ordered handover of a link's frames to a handler on its reader task (``Link.deliver_to``).

Items come in announcement order: frames, bulk bodies still to be read
(``BulkBody``) and bodies being read (futures of their frames). A frame goes to
the handler once everything before it has. A body's read, and so its body
sink's choice of buffer, starts once no unhandled frame precedes it: a frame
that sets up a body (a KV begin, whose own body never goes on a lane:
``LinkWriter._on_bulk``) is always handled before the body is placed, while
bodies behind bodies are read back to back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.frames import Frame
from mlxcel_plugin.link.protocol.record_reader import BulkBody

logger = logging.getLogger("mlxcel_plugin.link")

Item = Frame | BulkBody | asyncio.Future


class FrameDelivery:
    def __init__(
        self,
        handler: Callable[[Frame], None],
        start_read: Callable[[BulkBody], asyncio.Future],
        fail: Callable[[BaseException], None],
        label: str,
    ):
        self._handler, self._start_read, self._fail = handler, start_read, fail
        self._label = label  # for the log: "<this node> from <peer>"
        self._queue: collections.deque[Item] = collections.deque()
        self._failed = False  # after a handler failure nothing more is handed over

    def put(self, item: Item) -> None:
        if self._failed:
            return
        self._queue.append(item)
        if isinstance(item, asyncio.Future) and not item.done():
            item.add_done_callback(self._advance_later)
        self.advance()

    def advance(self) -> None:
        """Hand over every frame that is ready, then start the reads nothing holds back."""
        self._hand_ready_frames()
        for i, item in enumerate(self._queue):  # bounded by the queue
            if isinstance(item, BulkBody):
                self._queue[i] = read = self._start_read(item)
                read.add_done_callback(self._advance_later)
            elif not isinstance(item, asyncio.Future):
                return  # a frame not yet handled: the bodies behind it wait for it

    def _advance_later(self, _: asyncio.Future) -> None:
        self.advance()

    def _hand_ready_frames(self) -> None:
        while self._queue:  # bounded by the queue; stops at a body not yet in
            head = self._queue[0]
            if isinstance(head, BulkBody):
                return
            if isinstance(head, asyncio.Future):
                if not head.done():
                    return
                head = None if head.cancelled() else head.result()
            self._queue.popleft()
            if head is None:  # a body that failed (the link is closing) or an unknown type
                continue
            try:
                self._handler(head)
            except ProtocolError as exc:
                self._stop(exc)
                return
            except Exception as exc:  # the app's handler failed: this link only
                logger.exception("link %s: frame handler failed on a %s frame",
                                 self._label, head.type.name)
                self._stop(exc)
                return

    def _stop(self, exc: BaseException) -> None:
        self._failed = True
        self._queue.clear()
        self._fail(exc)
