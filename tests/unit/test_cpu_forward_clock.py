"""A CPU forward is timed by the CPU time of the thread that runs it when torch has one thread
(the servers' setting on a shared machine), so waiting (preemption, the GIL held by another
thread) is not counted as the model's cost; with several torch threads, or tensor-parallel ranks,
it is the wall clock."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specdec.engine.timing import ForwardClock, host_clock


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def spin(seconds: float) -> None:
    """Work for `seconds` of this thread's CPU time (however long that takes on a busy machine)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_one_thread_counts_work_and_not_waiting(torch_threads):
    torch_threads(1)
    clock = ForwardClock(torch.device("cpu"))
    with clock.forward():
        spin(0.02)  # work on this thread
        time.sleep(0.1)  # waiting: another process or thread has the core
    with clock.forward(2):  # a span of two forwards: each half of it
        spin(0.02)
    (waited, half, other_half) = clock.seconds()
    assert 0.019 < waited < 0.07, waited   # the work, not the 0.1 s wait
    assert half == other_half and 0.0095 < half < 0.035, half


def test_one_thread_does_not_count_a_gil_holder(torch_threads):
    """The server's gRPC and metrics threads hold the GIL at times during a forward."""
    torch_threads(1)
    clock = ForwardClock(torch.device("cpu"))
    holder = threading.Thread(target=spin, args=(0.15,))
    with clock.forward():
        holder.start()
        spin(0.02)
        holder.join()  # the wall clock includes the holder's spin
    (t,) = clock.seconds()
    assert t < 0.1, t


def test_several_threads_use_the_wall_clock(torch_threads):
    torch_threads(2)
    assert host_clock(torch.device("cpu")) is time.perf_counter
    clock = ForwardClock(torch.device("cpu"))
    with clock.forward():
        time.sleep(0.05)  # stands for work on torch's other threads, invisible to this one's CPU time
    (t,) = clock.seconds()
    assert t >= 0.05, t
    torch_threads(1)
    assert host_clock(torch.device("cpu")) is time.thread_time
    # a tensor-parallel rank waits for the others in its all-reduces: part of its forward
    assert host_clock(torch.device("cpu"), ranks=2) is time.perf_counter
    assert ForwardClock(torch.device("cpu"), ranks=2)._now is time.perf_counter
    assert host_clock(torch.device("meta")) is time.perf_counter
