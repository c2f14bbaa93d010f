"""What in-process fake model servers share for the coordinator's step loop (coordinator.servers.
ModelServer's surface besides step and release)."""
from __future__ import annotations

from protos import specdec_pb2 as pb


class QuietServer:
    """Answers Info at once; nothing to reset or close."""

    async def wait_ready(self, timeout: float):
        return pb.ModelInfo()

    def reset(self) -> None:
        pass

    def needs_info(self) -> bool:   # it never restarts
        return False

    async def close(self) -> None:
        pass
