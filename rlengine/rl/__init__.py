"""Reinforcement learning on the engine: environments, rollouts, the async training loop, recipes.

``types`` holds the abstractions (``Env``, ``AgentEnv``, ``EnvGroupBuilder``,
``RLDataset``, trajectories), ``rollouts`` runs them through the engine,
``sandbox`` runs agent episodes in sandbox processes over IPC, ``agents``
agent programs (any framework, any language) over HTTP, ``advantages``
turns groups into training data, ``loop`` is the pipeline with its shutdown
cascade, ``batch`` one training step's batch and the training calls it
makes, ``checkpoint``, ``metrics`` and ``plot`` what a run leaves on disk,
``run`` one run end to end, ``recipes`` the built-in tasks and ``cli`` the
``rlengine train`` command. Importing this package imports no torch.
"""

from rlengine.rl.config import TrainConfig
from rlengine.rl.errors import CheckpointError, DataExhausted, InvalidReward, RunInterrupted, StageTimeout
from rlengine.rl.types import (
    AgentEnv,
    AttemptFailure,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    StepResult,
    Trajectory,
    TrajectoryGroup,
    Transition,
)

__all__ = ["AgentEnv", "AttemptFailure", "CheckpointError", "DataExhausted", "Env", "EnvGroupBuilder", "InvalidReward",
           "Observation", "RLDataset", "RunInterrupted", "StageTimeout", "StepResult", "TrainConfig", "Trajectory",
           "TrajectoryGroup", "Transition"]
