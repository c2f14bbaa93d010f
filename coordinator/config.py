"""The coordinator's configuration: one frozen object, built in __main__ and passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass

GAMMA_POLICIES = ("fixed", "auto")
PIPELINE_MODES = ("auto", "on", "off")
STEP_CHANNELS = ("auto", "grpc")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it."""


@dataclass(frozen=True)
class CoordinatorConfig:
    target: str                       # target server address, host:port
    draft: str | None = None          # draft server address; None: plain decoding only
    host: str = "[::]"
    port: int = 50050
    metrics_port: int = -1            # Prometheus /metrics; 0: a free port (logged); -1: none
    tokenizer: str | None = None      # folder or tokenizer.json; None: the target's model folder
    max_batch_size: int = 32          # sequences in one step
    max_waiting: int = 64             # requests queued behind a batch that slots or KV keep full
    num_draft: int = 4                # default draft tokens per step
    max_num_draft: int = 8            # most a request (or the auto policy) may ask for
    gamma_policy: str = "fixed"       # how num_draft is chosen when a request leaves it to us
    spec_max_batch: int = 0           # steps with more running sequences decode plainly; 0: no limit
    prefill_chunk: int = 512          # prompt tokens per target step, all prompts together (chunked)
    connect_timeout_s: float = 60.0   # how long start-up, and recovery from a lost target, wait for a server
    target_timeout_s: float = 120.0   # a target step slower than this counts as the target lost
    draft_timeout_s: float = 30.0     # a draft step slower than this counts as the draft failing
    draft_retry_s: float = 5.0        # how often a lost draft server is tried again
    grace_s: float = 5.0              # SIGTERM: in-flight requests may finish this long
    busy_poll_ms: float = 0.0         # the loop polls instead of sleeping this long after each step
    pipeline: str = "auto"            # pipelined speculation: on, off, auto (on when the draft has its own GPU)
    step_channel: str = "auto"        # steps over a server's step channel where it has one (auto), or gRPC
    seq_id_base: int = 0              # the first sequence id; 0: a random one (coordinator/app.py)

    def __post_init__(self) -> None:
        if not self.target:
            raise ConfigError("target: an address host:port is required")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be in -1..65535, got {self.metrics_port}")
        for name in ("max_batch_size", "max_num_draft", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.spec_max_batch < 0:
            raise ConfigError(f"spec_max_batch must be >= 0 (0: no limit), got {self.spec_max_batch}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0 <= self.num_draft <= self.max_num_draft:
            raise ConfigError(f"num_draft must be in 0..max_num_draft ({self.max_num_draft}), got {self.num_draft}")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ConfigError(f"gamma_policy: expected one of {GAMMA_POLICIES}, got {self.gamma_policy!r}")
        if self.pipeline not in PIPELINE_MODES:
            raise ConfigError(f"pipeline: expected one of {PIPELINE_MODES}, got {self.pipeline!r}")
        if self.step_channel not in STEP_CHANNELS:
            raise ConfigError(f"step_channel: expected one of {STEP_CHANNELS}, got {self.step_channel!r}")
        if self.busy_poll_ms < 0:
            raise ConfigError(f"busy_poll_ms must be >= 0, got {self.busy_poll_ms}")
        for name in ("connect_timeout_s", "target_timeout_s", "draft_timeout_s", "draft_retry_s", "grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
