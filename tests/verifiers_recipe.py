"""A recipe whose episodes are rollouts of a verifiers environment: ``rlengine train verifiers_recipe:RECIPE``.

verifiers pins ``openai`` 2.x, which the main environment cannot hold, so
the environment lives in its own virtualenv (``RLENGINE_VERIFIERS_VENV``,
default ``.venv-verifiers`` in the repository; ``VENV_HINT`` says how to
make it) and the trainer never imports it. Every episode is one process of
that venv's interpreter, started by a sandbox worker (an ``AgentProgram``
in an ``HttpAgentEnv``): ``verifiers_env/run_episode.py``, which runs
verifiers' own ``vf-eval``, unchanged, on the episode's task for one
rollout against the episode's session base URL and prints the reward
verifiers' rubric gave it. The environment is ``verifiers_env/lookup_env.py``:
one tool, ``lookup(key)``, two tasks (``alpha`` is 42, ``beta`` is 7)
whose answer is the tool's value. The trainer trains on the session's exact
trace: every request verifiers' harness sent on that base URL, token for
token, with the engine's own logprobs and policy versions.

The engine is the scripted backend on the tiny model (``scripted=True``, the
default): the completions are ``SCRIPT`` in turn (a lookup of ``alpha``,
the answer 42, the same lookup, the answer 7), dealt out in the order
requests arrive, whichever episode sends them. An episode ends with the
first answer it gets (a reply without a tool call), so the two episodes of
a group get one answer each, 42 and 7 (which gets which is timing's), and
make two lookups in all (one each, or both in one episode); a step of one
such group uses the script once through, so the next starts it afresh.
Whatever the task, a group's rewards are one 1 and one 0: a real learning
signal, which a test can check trajectory by trajectory. ``scripted=False``
samples the tiny model itself on ``backend`` (it calls no tool; every
reward is 0).

Groups take the tasks in turn (batch ``i``, group ``j``: task ``(i *
groups_per_batch + j) % 2``). An episode costs about 17 s of a quiet CPU,
nearly all of it process starts: ``vf-eval``'s and its tool server's
imports (~6 s each) and verifiers' harness process (a few seconds). One process per
episode is the simple shape, not a fast one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import msgspec

from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.agents import AgentProgram, HttpAgentEnv
from rlengine.rl.config import TrainConfig
from rlengine.rl.recipes import Recipe
from rlengine.rl.sandbox import SandboxPool
from rlengine.rl.types import AgentEnv, EnvGroupBuilder, RLDataset
from rlengine.validation import PositiveFloat, PositiveInt, validate

__all__ = ["ANSWERS", "CALL", "KEYS", "RECIPE", "SCRIPT", "VENV", "VENV_HINT", "VERSION", "venv_python"]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EPISODE = os.path.join(HERE, "verifiers_env", "run_episode.py")
VENV = os.environ.get("RLENGINE_VERIFIERS_VENV", os.path.join(REPO, ".venv-verifiers"))
VENV_HINT = ("python -m venv .venv-verifiers && .venv-verifiers/bin/pip install -q verifiers==0.4.0 "
             "(in the repository root, or point RLENGINE_VERIFIERS_VENV at such a venv)")
VERSION = "0.4.0"

KEYS = ("alpha", "beta")
"""The tasks of ``lookup_env``, by name, in the order groups take them."""
CALL = '<tool_call>\n{"name":"lookup","arguments":{"key":"alpha"}}\n</tool_call>'
ANSWERS = {"42": "The value is 42.", "7": "The value is 7."}
SCRIPT = (CALL, ANSWERS["42"], CALL, ANSWERS["7"])


def venv_python() -> tuple[str, str]:
    """The verifiers venv's interpreter and its base installation's prefix (what a sandbox worker
    under a uid of its own must be able to read); ``ConfigurationError`` with ``VENV_HINT`` when
    there is no venv with verifiers ``VERSION``."""
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(os.path.join(VENV, "bin", "vf-eval")):
        raise ConfigurationError(f"no verifiers venv at {VENV} (it needs verifiers=={VERSION}); "
                                 f"create it with: {VENV_HINT}")
    code = "import importlib.metadata as m, sys; print(m.version('verifiers')); print(sys.base_prefix)"
    probe = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    version, _, base = probe.stdout.strip().partition("\n")
    if version != VERSION:
        raise ConfigurationError(f"{VENV} holds verifiers {version or probe.stderr.strip()!r}, not {VERSION}; "
                                 f"recreate it with: {VENV_HINT}")
    return python, base


class VerifiersOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    scripted: bool = True
    """The engine's completions are ``SCRIPT`` (the scripted backend); False samples the tiny model."""
    sandboxes: PositiveInt = 1
    """Sandbox worker processes; each starts the episodes it is given, at once, one process each."""
    job_timeout_s: PositiveFloat = 240.0
    """Longest one episode may take in its sandbox (its session's deadline is 0.9 of it)."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)


class _World:
    """What the environments reach at run time: the server and the pool of episode programs."""

    def __init__(self, options: VerifiersOptions, python: str, base: str) -> None:
        self.options = options
        self.python = python
        """The verifiers venv's interpreter, which runs every episode's program."""
        self.base = base
        """The prefix of the installation that interpreter comes from."""
        self.pool: SandboxPool | None = None
        self.server: Any = None

    def env(self, key: str) -> AgentEnv:
        if self.pool is None:
            raise RuntimeError("the verifiers recipe's sandboxes are not running (Recipe.attach was not entered)")
        return HttpAgentEnv(self.pool, self.server, {"key": key}, metadata={"key": key})


class LookupGroup(EnvGroupBuilder):
    def __init__(self, world: _World, key: str, size: int) -> None:
        self.world = world
        self.key = key
        self.size = size

    async def make_envs(self) -> Sequence[AgentEnv]:
        return [self.world.env(self.key) for _ in range(self.size)]

    def metadata(self) -> dict[str, Any]:
        return {"key": self.key}


class LookupTasks(RLDataset):
    """``batches`` batches of ``groups`` groups, taking the tasks in turn."""

    def __init__(self, world: _World, batches: int, groups: int, group_size: int) -> None:
        self.world = world
        self.batches = batches
        self.groups = groups
        self.group_size = group_size

    def __len__(self) -> int:
        return self.batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < self.batches:
            raise IndexError(f"batch {index} of {self.batches}")
        return [LookupGroup(self.world, KEYS[(index * self.groups + j) % len(KEYS)], self.group_size)
                for j in range(self.groups)]


class VerifiersLookup(Recipe):
    name = "verifiers_lookup"
    description = "a verifiers environment (one tool, two tasks), each rollout verifiers' vf-eval in its own venv"
    defaults: ClassVar[dict[str, Any]] = {"groups_per_batch": 1, "group_size": 2, "max_tokens": 64, "max_turns": 4,
                                          "backend": "torch"}
    Options = VerifiersOptions

    def engine_config(self, config: TrainConfig, options: VerifiersOptions) -> EngineConfig:
        if options.scripted:
            return EngineConfig(model="tiny", backend="scripted", cache_dir=config.cache_dir,
                                engine_args={"script": list(SCRIPT)})
        if config.backend == "sim":
            raise ConfigurationError("backend='sim': verifiers' harness needs a model with a chat template "
                                     "(torch or vllm)")
        return EngineConfig(model="tiny", backend=config.backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: VerifiersOptions) -> tuple[RLDataset, None]:
        batches = config.steps if config.steps is not None else len(KEYS)
        # No venv to run episodes in refuses the run here, before the engine starts.
        return LookupTasks(_World(options, *venv_python()), batches, config.groups_per_batch, config.group_size), None

    @contextlib.asynccontextmanager
    async def attach(self, engine: Any, dataset: RLDataset, eval_dataset: RLDataset | None) -> AsyncIterator[None]:
        """The HTTP server on the engine (loopback, a drawn key) and the pool of episode programs, for the run."""
        from rlengine.serve import ServeConfig, Server

        assert isinstance(dataset, LookupTasks)
        world = dataset.world
        async with Server(engine, ServeConfig(ipc=False)) as server:
            program = AgentProgram([world.python, EPISODE, server.model_name])
            # Workers under uids of their own see directories closed to others only where mounted back:
            # the venv and the installation its interpreter comes from.
            pool = program.pool(world.options.sandboxes, job_timeout_s=world.options.job_timeout_s,
                                readable=(VENV, world.base))
            try:
                await pool.start(None)
                world.pool, world.server = pool, server
                yield
            finally:
                world.pool = None
                await pool.aclose()


RECIPE = VerifiersLookup()
