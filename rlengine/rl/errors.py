"""Errors of the RL loop, under rlengine's one root (``rlengine.errors``).

Each class also inherits the stdlib type a caller would catch; messages name
the field or stage and the value. The loop adds a note naming the stage an
error came from (``exc.add_note``) and re-raises the original exception, so
a user's own exception type survives the shutdown cascade unchanged; these
classes are for what the loop itself detects. Standard library only.
"""

from __future__ import annotations

from rlengine.errors import RLEngineError

__all__ = ["CheckpointError", "DataExhausted", "FailureBudgetExceeded", "InvalidReward", "RolloutDumpError",
           "RunInterrupted", "StageTimeout"]


class DataExhausted(RLEngineError, RuntimeError):
    """The dataset ran out before the requested number of steps."""

    def __init__(self, batch: int, steps: int, length: int) -> None:
        self.batch = batch
        self.steps = steps
        self.length = length
        super().__init__(f"steps={steps}: the dataset ran out at batch {batch} (it has {length} batches)")


class InvalidReward(RLEngineError, ValueError):
    """An environment or group builder returned a reward that is not a finite number."""

    def __init__(self, where: str, value: object) -> None:
        self.where = where
        self.value = value
        super().__init__(f"{where}={value!r}: a reward must be a finite number")


class RunInterrupted(RLEngineError, RuntimeError):
    """The run was stopped by a signal (SIGINT or SIGTERM); exit code 128 + signal number."""

    def __init__(self, signum: int, name: str) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {name}")


class FailureBudgetExceeded(RLEngineError, RuntimeError):
    """Too many attempts failed, or too many groups went untrained, over the last steps: the run
    is not learning from what it samples (crashing sandboxes, a broken environment), so it stops."""

    def __init__(self, what: str, share: float, bound: float, steps: int) -> None:
        self.what = what
        self.share = share
        self.bound = bound
        super().__init__(f"{what}: {share:.0%} over the last {steps} step(s), more than max_failure_share="
                         f"{bound:g}; the run stops rather than train on what is left")


class StageTimeout(RLEngineError, TimeoutError):
    """A bounded wait inside the loop ran out (a training call, an episode, a shutdown)."""


class CheckpointError(RLEngineError, OSError):
    """A checkpoint could not be written or read, or does not match this run."""


class RolloutDumpError(RLEngineError, ValueError):
    """A rollout dump file (``train_from``) cannot be read: missing, corrupt, of another
    format version, or not the step it should hold. ``path`` names the file."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")
