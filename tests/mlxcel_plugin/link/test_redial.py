"""Redial: backoff across failed dials and young links, reset by a stable link; log lines."""

import logging

from mlxcel_plugin.link import Backoff
from mlxcel_plugin.link.dial import Redial

BACKOFF = Backoff(initial_s=0.1, max_s=1.0, jitter=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def redial(clock: Clock, **kwargs) -> Redial:
    return Redial(BACKOFF, "peer-x", clock=clock, rng=lambda: 0.5, **kwargs)


def test_failed_dials_back_off_exponentially_up_to_the_cap():
    r = redial(Clock())
    assert [r.failed("refused") for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert r.failed("at capacity", min_delay_s=3.0) == 3.0


def test_a_link_that_drops_right_after_its_handshake_counts_as_a_failure():
    clock = Clock()
    r = redial(clock, stable_s=5.0)
    delays = []
    for _ in range(4):
        r.connected()
        clock.now += 0.01
        delays.append(r.lost())
    assert delays == [0.1, 0.2, 0.4, 0.8]
    assert r.flapping  # a re-probe must not cut these delays short


def test_a_stable_link_starts_over_and_a_refused_dial_is_not_flapping():
    clock = Clock()
    r = redial(clock, stable_s=5.0)
    for _ in range(3):
        r.connected()
        r.lost()
    assert r.flapping
    r.failed("refused")  # down now, not failing after handshakes: wakes help again
    assert not r.flapping
    r.connected()
    clock.now += 6.0
    assert r.lost() == 0.0 and r.streak == 0
    assert r.failed("refused") == 0.1


def test_one_log_line_per_backoff_step_then_one_per_interval_at_the_cap(caplog):
    clock = Clock()
    r = redial(clock, log_every_s=60.0)
    with caplog.at_level(logging.WARNING, "mlxcel_plugin.link"):
        for _ in range(200):  # 4 steps below the cap, then 196 dials at it
            clock.now += r.failed("refused")
    lines = [rec.getMessage() for rec in caplog.records]
    # 0.1, 0.2, 0.4, 0.8, then the first at the cap; ~196 s at the cap: 3 more lines.
    assert 5 <= len(lines) <= 9
    assert "failed dial(s) since the last line" in lines[-1]
    assert sum(int(line.split(";")[1].split()[0]) for line in lines) <= 200
