"""The engine's exceptions. Each names what was wrong, so callers can act on it."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request was refused before it was accepted; nothing else was affected."""


class EmptyPromptError(InvalidRequestError):
    pass


class PromptTooLongError(InvalidRequestError):
    pass


class DuplicateRequestError(InvalidRequestError):
    pass


class UnknownRequestError(EngineError, KeyError):
    """An abort (or query) named a request the engine does not hold."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class PauseInProgressError(EngineError):
    """Resume, sleep or a second pause arrived while a pause is still completing."""


class EngineAsleepError(EngineError):
    """Resume was asked while part of the engine is still asleep; wake it up first."""


class EngineDeadError(EngineError):
    """The engine stopped after a failure; every later call raises this at once."""


class EngineClosedError(EngineError):
    """The engine's `async with` block has ended; it takes no more calls."""


class BackendUnavailableError(EngineError):
    """The configured DP backend needs a package that is not installed (the message says
    which, and how to install it)."""


class ScalingInProgressError(EngineError):
    """`scale` was called while another reconfiguration is still active."""


class ScalingFailedError(EngineError):
    """A scale failed and was rolled back; the engine serves at its old size."""


class ScalingRefusedError(EngineError):
    """`scale` was refused before anything changed (bad size, or the engine is paused)."""


class RankCallError(EngineError):
    """A call was refused by one or more ranks; the message names them and why."""


class WeightUpdateRefusedError(EngineError):
    """`update_weights` was called while the engine serves (or its weights are asleep):
    pause it, or wake the weights, first. Nothing changed."""


class WeightUpdateInProgressError(EngineError):
    """Resume, sleep or wake_up arrived while `update_weights` is still running."""


class WeightUpdateError(EngineError, ValueError):
    """New weights were refused (a missing, extra or misshapen tensor, an unreadable
    file, a failing rank); the message names it. Every rank kept its old weights."""


class ProfilerStateError(EngineError):
    """`start_profile` while the profiler runs, or `stop_profile` while it does not."""


class CollectiveRpcError(EngineError):
    """`collective_rpc` failed: an unregistered method, bad arguments, or a rank that
    raised or did not answer in time; the message names the rank."""


class LoRAError(EngineError, ValueError):
    """A LoRA adapter was refused (a missing, truncated or `.bin` file, a bad
    `adapter_config.json`, an unknown target module, a rank above `max_lora_rank`, a
    tensor that does not fit the base model, a rank that could not load it), or an
    adapter call cannot be done now (adapters off, every slot pinned); the message
    names the adapter, the file or tensor, and the rank. Nothing else changed."""


class UnknownLoRAError(InvalidRequestError):
    """A request or a call named an adapter the engine does not hold."""
