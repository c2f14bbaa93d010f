"""specdec/busy_poll.py: the loop polls for a window after a kick, sleeps again after it, and not
at all while paused (work on another thread) or when the window is 0."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.busy_poll import BusyPoll


def run(coro):
    return asyncio.run(coro)


def test_polls_for_the_window_then_sleeps():
    async def main():
        poll = BusyPoll(0.05)
        poll.kick()
        await asyncio.sleep(0.02)
        during = poll.polls
        await asyncio.sleep(0.06)             # the window has passed: the poller waits again
        after = poll.polls
        await asyncio.sleep(0.05)
        idle = poll.polls - after
        poll.kick()                           # traffic again: polling resumes
        await asyncio.sleep(0.02)
        again = poll.polls - after
        poll.close()
        return during, idle, again
    during, idle, again = run(main())
    assert during > 50, during                # polled many times in 20 ms (it would be 1-2 asleep)
    assert idle <= 1, idle
    assert again > 50, again


def test_paused_and_disabled_never_poll():
    async def main():
        poll = BusyPoll(0.2)
        with poll.paused():
            poll.kick()
            await asyncio.sleep(0.03)
            paused = poll.polls
        await asyncio.sleep(0.02)             # unpaused inside the window: polls
        resumed = poll.polls - paused
        poll.close()
        off = BusyPoll(0.0)
        off.kick()
        await asyncio.sleep(0.02)
        return paused, resumed, off.polls, off._task
    paused, resumed, off_polls, off_task = run(main())
    assert paused <= 1 and resumed > 50 and off_polls == 0 and off_task is None


def test_other_tasks_still_run_while_polling():
    async def main():
        poll = BusyPoll(0.5)
        poll.kick()
        t0 = time.monotonic()
        await asyncio.sleep(0.03)             # a timer fires on time while the loop polls
        late = time.monotonic() - t0 - 0.03
        poll.close()
        return late
    assert run(main()) < 0.02


def test_negative_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        BusyPoll(-1)
