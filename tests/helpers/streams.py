"""A model server's bidi step stream driven from a test with a per-step timeout: a reader thread
moves responses (or the RpcError / "end" that ended the stream) into a queue, so an unanswered
step fails the test instead of hanging it."""
from __future__ import annotations

import queue
import threading

import grpc

END = None  # what send() takes to half-close the stream


def describe(item) -> str:
    if isinstance(item, grpc.RpcError):
        return f"{item.code()}: {item.details()}"
    return repr(item)


class StepStream:
    step_timeout = 30.0

    def __init__(self, method, deadline: float = 120.0):
        self._requests: queue.Queue = queue.Queue()
        self._responses: queue.Queue = queue.Queue()
        self.call = method(iter(self._requests.get, END), timeout=deadline)
        self.ended: grpc.RpcError | str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self._responses.put(response)
            self._responses.put("end")
        except grpc.RpcError as e:
            self._responses.put(e)

    def send(self, request) -> None:
        self._requests.put(request)

    def receive(self, timeout: float | None = None):
        """The next response; an RpcError or 'end' when the stream ended instead."""
        timeout = self.step_timeout if timeout is None else timeout
        try:
            item = self._responses.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout}s: a hung stream") from None
        if not hasattr(item, "results"):
            self.ended = item
        return item

    def step(self, request, timeout: float | None = None):
        self.send(request)
        response = self.receive(timeout)
        assert hasattr(response, "results"), f"step {request.step}: the stream ended: {describe(response)}"
        return response
