"""Container health check: exit 0 when a gRPC server answers the standard health service SERVING.

    python deploy/healthcheck.py localhost:50051 [service]

The servers register grpc.health.v1 (grpcio-health-checking); "" asks about the whole server.
Standard library + grpcio only, so it runs in the image without any test tool.
"""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name} {err.details()}", file=sys.stderr)
            return False
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return serving


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if check(argv[1], argv[2] if len(argv) == 3 else "") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
