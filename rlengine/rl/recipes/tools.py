"""Recipe ``tools``: an OpenAI-client agent that must call a tool to answer, learned by RL alone on CPU.

Each episode is an agent in a sandbox worker (``tools_agent``) that talks to
the engine's HTTP server with the official ``openai`` client and
``tools=[read_meter]``: the user asks ``?`` (what does the meter read?), the
reading is a random digit only the tool returns, and the reward checks the
answer (0.8 when it is the reading, 0.2 for having called the tool and answered). The
trainer trains on each session's exact trace (``rlengine.rl.agents``).

The model, its vocabulary, chat template and tool-call syntax are chosen so
that RL from random init can learn it on two CPU cores in minutes:

* a character-level Qwen2 (``build_char_model``) over ``ALPHABET``: the
  digits, ``?``, ``@`` (a tool call), ``=`` (a tool result), ``U`` / ``A``
  (user / assistant) and ``$`` (end of a message, the model's end token);
* its chat template writes a conversation as ``U?$A@$=7$A7$``: user ``?``,
  the assistant calls the tool (``@``), the tool answers ``7``, the assistant
  answers ``7``. Tools are not written out (there is one, always offered);
* the tool-call syntax (``MeterCalls``, registered as tool parser ``meter``)
  reads an assistant turn that is exactly ``@`` as a call of ``read_meter``
  with no arguments; any other text holding ``@`` is a malformed call
  (returned as text, counted), anything else the answer.

A turn is one sampled token (``max_tokens=1``), at most two turns (call,
answer). A random policy calls the tool in one turn of sixteen and guesses
the digit in one of ten: its mean reward is about 0.07. Calling is learned
first (it pays 0.2 at once), then copying the tool's digit into the answer.
GRPO groups of 8, PPO with 4 optimizer steps per batch, Adam at 2e-3, and
an entropy bonus of 0.05 (at 0.02 the answer collapsed onto one digit,
whatever the tool said, and most groups had constant rewards); groups whose
rewards are all equal are not trained (``skip_constant_reward``; with the
bonus kept on for them, as ``copy`` does, seed 2 dropped the tool call from
near 1 to near 0 twice and was at 0.08 after 51 steps; without, it reached
0.84 at step 61, one such drop recovered within 3 steps). Two sandbox
workers play the episodes concurrently.

With ``model=`` the agent is the same; the user asks ``QUESTION`` in words,
the given model's chat template renders the conversation (it must write the
tools it is offered), its tool calls are read by ``tool_parser`` (None: the
one its template writes, e.g. ``hermes``) and a turn may take ``max_tokens``
tokens (more than one: a call is a few dozen). The recipe refuses a model
without a chat template, one whose template drops the tools, or one whose
context cannot hold a call, its result and an answer.

``crash_every`` > 0 is fault injection: every n-th episode's agent exits
mid-game; its attempt fails (``crash``), is left out of its group's
advantages, and the run goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError
from rlengine.rl.agents import HttpAgentEnv
from rlengine.rl.config import TrainConfig
from rlengine.rl.recipes import DigitTasks, EveryDigit, GivenModel, Recipe, given_model
from rlengine.rl.recipes.tools_agent import ALPHABET, QUESTION, TOOL, TOOLS
from rlengine.rl.sandbox import SandboxPool
from rlengine.rl.types import AgentEnv, RLDataset
from rlengine.tool_parsers import PARSERS, ParsedTurn, ToolCall, new_call_id, parser_for, register
from rlengine.validation import NonNegativeInt, PositiveFloat, PositiveInt, validate

__all__ = ["ALPHABET", "CHAT_TEMPLATE", "RECIPE", "MeterCalls", "ToolsOptions", "ToolsRecipe"]

AGENT_MODULE = "rlengine.rl.recipes.tools_agent"
END = "$"
CALL = "@"

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}U{{ m['content'] }}$"
    "{%- elif m['role'] == 'assistant' -%}A{{ m['content'] or '' }}"
    "{%- for c in m.get('tool_calls') or [] -%}@{%- endfor -%}$"
    "{%- elif m['role'] == 'tool' -%}={{ m['content'] }}$"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A{%- endif -%}"
)
"""User ``U..$``, assistant ``A..$`` (each tool call an ``@``), tool result ``=..$``; system messages
and tool definitions are not written."""


class MeterCalls:
    """The tool-call syntax of the ``tools`` recipe's model: a turn that is exactly ``@`` calls
    ``read_meter`` (no arguments). Text holding ``@`` otherwise is a malformed call."""

    name = "meter"
    start_marker = CALL

    def __init__(self) -> None:
        self.malformed = 0

    def parse(self, text: str) -> ParsedTurn:
        if CALL not in text:
            return ParsedTurn(text, [], False)
        if text.strip(CALL) == "":
            return ParsedTurn(None, [ToolCall(new_call_id(), TOOL, "{}") for _ in text], False)
        self.malformed += 1
        return ParsedTurn(text, [], True)

    def split_closing(self, rendered: str) -> tuple[str, str]:
        end = rendered.rfind(CALL) + 1
        return (rendered[:end], rendered[end:]) if end else (rendered, "")

    def call_tag(self, name: str) -> tuple[str, str, str]:
        raise ValueError("the meter syntax has no arguments to constrain: forced tool calls are not supported")


register(MeterCalls.name, MeterCalls)


class ToolsOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    sandboxes: PositiveInt = 2
    """Sandbox worker processes (each plays many episodes at once)."""
    job_timeout_s: PositiveFloat = 60.0
    """The sandbox's bound on one episode (exceeds the rollout deadline)."""
    deadline_s: PositiveFloat | None = None
    """The rollout deadline of one episode; None: 0.9 of ``job_timeout_s``."""
    crash_every: NonNegativeInt = 0
    """Fault injection: every n-th episode's agent exits mid-game (0: never)."""
    tool_parser: str | None = None
    """How the model writes tool calls (``rlengine.tool_parsers``); None: ``meter`` for the recipe's
    own model, the format the chat template writes with ``model=``."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)


class _World:
    """What the environments reach at run time: the server and the sandbox pool."""

    def __init__(self, options: ToolsOptions, tool_parser: str, question: str | None) -> None:
        self.options = options
        self.tool_parser = tool_parser
        self.question = question
        self.pool: SandboxPool | None = None
        self.server: Any = None
        self._episodes = 0

    def env(self, reading: int, group: int) -> AgentEnv:
        if self.pool is None:
            raise RuntimeError("the tools recipe's sandboxes are not running (Recipe.attach was not entered)")
        self._episodes += 1
        task: dict[str, Any] = {"reading": reading}
        if self.question is not None:
            task["question"] = self.question
        every = self.options.crash_every
        if every and self._episodes % every == 0:
            task["crash"] = True
        return HttpAgentEnv(self.pool, self.server, task, metadata={"reading": reading, "group": group},
                            deadline_s=self.options.deadline_s)


def fit_model(model: GivenModel, config: TrainConfig, options: ToolsOptions) -> str:
    """The tool parser for ``model``, once its chat template and context are checked to fit the agent."""
    if config.max_tokens == 1:
        raise ConfigurationError(f"max_tokens={config.max_tokens}: with model={model.name!r} a turn is text and a "
                                 "tool call takes more than one token (e.g. max_tokens=64)")
    template = getattr(model.tokenizer, "chat_template", None)
    if not template:
        raise model.refuse("has no chat template; the tools recipe's agent talks to it in chat messages")
    call = {"id": "call_0", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}
    episode = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0", "content": "7"}]
    from jinja2 import TemplateError

    try:
        rendered = model.tokenizer.apply_chat_template(episode, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError) as exc:
        raise model.refuse(f"its chat template cannot render a tool call and its result: {exc}") from None
    if TOOLS[0]["function"]["description"] not in rendered:
        raise model.refuse(f"its chat template does not write the tools it is offered ({TOOL!r}'s description is "
                           "not in the rendered conversation); the tools recipe's agent must see tools=[read_meter]")
    try:
        parser = parser_for(template, options.tool_parser)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if parser is None:
        raise model.refuse(f"its chat template writes no tool-call format rlengine reads; set tool_parser=NAME "
                           f"(known: {', '.join(sorted(PARSERS))})")
    model.check_context(len(model.encode(rendered)) + config.max_tokens,
                        f"a tool call, its result and an answer of max_tokens={config.max_tokens}")
    return parser.name


class ToolsRecipe(Recipe):
    name = "tools"
    description = "an openai-client agent with tools=[read_meter] over HTTP, in sandboxes; the answer is the tool's"
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 120, "groups_per_batch": 16, "group_size": 8, "max_tokens": 1, "max_turns": 2,
        "temperature": 1.0, "loss_fn": "ppo", "entropy_coef": 0.05, "learning_rate": 2e-3, "num_substeps": 4,
        "grad_clip_norm": 1.0, "skip_constant_reward": True, "eval_every": 25, "eval_temperature": 0.0,
        "min_surviving_attempts": 2, "backend": "torch", "target_reward": 0.8,
    }
    Options = ToolsOptions
    requires: ClassVar[dict[str, str]] = {"openai": "agents", "httpx": "agents"}
    """Its agent's client (``tools_agent``), imported in the sandbox workers."""

    def engine_config(self, config: TrainConfig, options: ToolsOptions) -> EngineConfig:
        if config.backend == "sim":
            raise ConfigurationError("backend='sim': the tools recipe needs a model backend (torch or vllm)")
        self.check_requires()
        if not config.episode_timeout_s > options.job_timeout_s:
            raise ConfigurationError(f"episode_timeout_s={config.episode_timeout_s}: must exceed the sandbox's bound "
                                     f"job_timeout_s={options.job_timeout_s}")
        model = given_model(config, self.name)
        if model is not None:
            fit_model(model, config, options)
            return model.engine_config(config)
        if config.max_tokens != 1:
            raise ConfigurationError(f"max_tokens={config.max_tokens}: a turn is one token (max_tokens=1)")
        path = prepare_char_model(ALPHABET, END, cache_dir=config.cache_dir, seed=config.seed,
                                  chat_template=CHAT_TEMPLATE, max_position_embeddings=max(64, 6 * config.max_turns + 8))
        return EngineConfig(model=path, backend=config.backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: ToolsOptions) -> tuple[RLDataset, RLDataset | None]:
        model = given_model(config, self.name)
        if model is None:
            world = _World(options, options.tool_parser or MeterCalls.name, None)
        else:
            world = _World(options, fit_model(model, config, options), QUESTION)
        batches = config.steps if config.steps is not None else 120
        return (DigitTasks(world, "reading", batches, config.groups_per_batch, config.group_size, config.seed),
                EveryDigit(world, "reading"))

    @contextlib.asynccontextmanager
    async def attach(self, engine: Engine, dataset: RLDataset, eval_dataset: RLDataset | None) -> AsyncIterator[None]:
        """The HTTP server on the engine (loopback, a drawn key) and the agents' sandbox pool."""
        from rlengine.serve import ServeConfig, Server

        assert isinstance(dataset, DigitTasks)
        world = dataset.world
        options = world.options
        async with Server(engine, ServeConfig(ipc=False, tool_parser=world.tool_parser, max_in_flight=4096)) as server, \
                SandboxPool(AGENT_MODULE, options.sandboxes, job_timeout_s=options.job_timeout_s) as pool:
            await pool.start(None)
            world.pool, world.server = pool, server
            try:
                yield
            finally:
                world.pool = None


RECIPE = ToolsRecipe()
