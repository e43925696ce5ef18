"""The link's send budget: waits while spent, lets an oversize frame go alone."""

import asyncio

from mlxcel_plugin.link.send_budget import ByteBudget


def is_open() -> bool:
    return True


def test_try_acquire_fits_within_the_budget_and_an_oversize_frame_goes_alone():
    budget = ByteBudget(10)
    assert budget.try_acquire(6) and not budget.try_acquire(6) and budget.used == 6
    budget.release(6)
    assert budget.try_acquire(25) and budget.used == 25  # alone: nothing else was queued
    assert not budget.try_acquire(1)


def test_acquire_waits_for_a_release_and_ends_when_the_link_closes():
    async def scenario() -> None:
        budget = ByteBudget(10)
        await budget.acquire(8, is_open)
        waiter = asyncio.create_task(budget.acquire(5, is_open))
        await asyncio.sleep(0)
        assert not waiter.done()
        budget.release(8)
        await asyncio.wait_for(waiter, 1)
        assert budget.used == 5
        closed = asyncio.create_task(budget.acquire(9, lambda: False))
        await asyncio.wait_for(closed, 1)  # a closed link never waits

    asyncio.run(scenario())
