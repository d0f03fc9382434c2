"""What `wavecore serve` was asked to do, apart from the engine's own configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    """`port=0` binds a free port. `api_key` None leaves the API open. `max_waiting`
    None never sheds load. `shutdown_timeout` is how long requests in flight may run on
    after SIGTERM or Ctrl-C before they are aborted."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    enable_admin_api: bool = False
    max_waiting: int | None = None
    shutdown_timeout: float = 30.0
    max_request_bytes: int = 2**20
    # Engine requests one call may ask for (prompts x n), and how long a body may take.
    max_requests_per_call: int = 64
    body_timeout: float = 30.0
    # Fair admission (`fairness`): engine requests admitted at once in all (None: the
    # sequences the engine runs at once), per client (None: 3/4 of that), and queued
    # per client before a 429.
    max_inflight: int | None = None
    max_inflight_per_client: int | None = None
    max_queued_per_client: int = 256

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_requests_per_call < 1:
            raise ValueError(
                f"--max-requests-per-call must be >= 1, got {self.max_requests_per_call}"
            )
        for flag, value in (
            ("--max-inflight", self.max_inflight),
            ("--max-inflight-per-client", self.max_inflight_per_client),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_queued_per_client < 0:
            raise ValueError(
                f"--max-queued-per-client must be >= 0, got {self.max_queued_per_client}"
            )
        if not self.body_timeout > 0:
            raise ValueError(f"--body-timeout must be > 0, got {self.body_timeout}")


def model_name_of(model: str | None) -> str:
    """The name clients pass as `model`: the file or directory name of `--model`
    without a `.gguf` suffix, or the default model's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
