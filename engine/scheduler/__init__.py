"""Continuous-batching scheduler and paged KV block manager (pure Python, no torch)."""

from .block_manager import BlockManager, BlockPoolExhaustedError, PrefixHit
from .config import SchedulerConfig
from .errors import (
    DuplicateRequestError,
    InvalidPromptError,
    OutputMismatchError,
    PromptTooLongError,
    StepOrderError,
)
from .outputs import RequestUpdate, SchedulerOutput, SchedulerStats
from .request import Request
from .scheduler import Scheduler

__all__ = [
    "BlockManager",
    "BlockPoolExhaustedError",
    "DuplicateRequestError",
    "InvalidPromptError",
    "OutputMismatchError",
    "PrefixHit",
    "PromptTooLongError",
    "Request",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepOrderError",
]
