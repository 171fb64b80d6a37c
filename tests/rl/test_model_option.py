"""``model=`` on every recipe (``TrainConfig.model``): a model of the user's in place of the recipe's own.

Fast, on models built here: the tiny model's directory (a byte-level BPE tokenizer with a ChatML
template that writes tools), a GGUF file written from it (tests/gguf_writer.py), and copies of the
tiny directory with one thing broken. Each recipe encodes with the given tokenizer, and each misfit
is refused with a ``ConfigurationError`` naming the setting and its value. The real model
(SmolLM2-135M-Instruct) is tests/rl/test_real_model.py, opt-in.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil

import numpy as np
import pytest
from gguf_writer import write_gguf

from rlengine.backends.torch.models import load_tokenizer, prepare_char_model
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.recipes import load_recipe
from rlengine.rl.recipes.copy_digits import ALPHABET, END, CharDigits, CopyEnv, TokenizerDigits
from rlengine.rl.recipes.tools_agent import QUESTION
from rlengine.rl.run import build_config, train

pytestmark = pytest.mark.model_plane


def setup(recipe: str, **settings):
    """The recipe, its settings from ``key=value`` strings (as the CLI gives them), and its datasets."""
    the_recipe = load_recipe(recipe)
    config, options = build_config(the_recipe, {k: str(v) for k, v in settings.items()})
    return the_recipe, config, options


def first_env(dataset) -> CopyEnv:
    return asyncio.run(dataset.get_batch(0)[0].make_envs())[0]


def altered(tiny_model: str, tmp_path, change) -> str:
    """A copy of the tiny model's directory with ``change(path)`` applied."""
    path = str(tmp_path / "altered")
    shutil.copytree(tiny_model, path)
    change(path)
    return path


def test_copy_takes_a_model_directory_and_encodes_with_its_tokenizer(tiny_model, model_cache) -> None:
    recipe, config, options = setup("copy", model=tiny_model, max_tokens=8, cache_dir=model_cache)
    assert config.model == tiny_model
    assert recipe.engine_config(config, options).model == tiny_model
    env = first_env(recipe.datasets(config, options)[0])
    tok = load_tokenizer(tiny_model)
    obs = asyncio.run(env.initial_observation())
    assert obs.max_tokens == 8
    assert tok.decode(obs.prompt.to_ints()) == tok.apply_chat_template(
        [{"role": "user", "content": f"Copy these digits exactly: {env.number}"}], tokenize=False,
        add_generation_prompt=True)
    digits, end = tok.encode(env.number), tok.convert_tokens_to_ids("<|im_end|>")
    assert len(digits) == 3

    def reward(action):
        return asyncio.run(env.step(action)).reward

    assert reward([*digits, end]) == 1.0
    assert reward(digits) == 0.75  # every digit, but no end
    assert reward([*digits[:1], end]) == 0.25
    assert reward([*tok.encode("x"), *digits, end]) == 0.0


def test_the_recipes_own_char_model_given_as_model_is_rewarded_the_same(model_cache) -> None:
    # Given by path, the recipe's own model has no chat template: the prompt is the raw "123=" and
    # the text reward equals the recipe's token reward on every answer.
    path = prepare_char_model(ALPHABET, END, cache_dir=model_cache, seed=0, max_position_embeddings=64)
    recipe, config, options = setup("copy", model=path, cache_dir=model_cache)
    given = first_env(recipe.datasets(config, options)[0])
    assert isinstance(given.digits, TokenizerDigits)
    own = CopyEnv(given.number, CharDigits())
    assert asyncio.run(given.initial_observation()).prompt == asyncio.run(own.initial_observation()).prompt
    rng = np.random.default_rng(0)
    answers = [own.target, own.target[:3], own.target[:1] + own.target[2:]] + \
        [list(map(int, rng.integers(1, len(ALPHABET) + 1, size=rng.integers(1, 5)))) for _ in range(200)]
    for action in answers:
        assert asyncio.run(given.step(action)).reward == asyncio.run(own.step(action)).reward, action


def test_a_gguf_file_trains_through_its_converted_directory(tiny_model, model_cache, tmp_path) -> None:
    gguf = write_gguf(tiny_model, str(tmp_path / "tiny.gguf"))
    recipe, config, options = setup("copy", model=gguf, max_tokens=8, cache_dir=model_cache)
    path = recipe.engine_config(config, options).model
    assert path.startswith(os.path.join(model_cache, "models", "gguf-tiny-"))
    assert os.path.isfile(os.path.join(path, "model.safetensors"))


def test_copy_runs_rl_steps_on_a_given_model(tiny_model, model_cache, tmp_path) -> None:
    outcome = train("copy", {"model": tiny_model, "cache_dir": model_cache, "steps": 2, "groups_per_batch": 2,
                             "group_size": 4, "max_tokens": 6, "eval_every": 0, "checkpoint_every": 0,
                             "num_substeps": 1, "learning_rate": 1e-4}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    steps = read_jsonl(outcome.metrics_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["loss_sum"]) and s["sampled_tokens_trained"] > 0
        assert 0 <= s["kl_sample_train_k3"] < 1e-5


def test_guess_plays_in_the_given_models_tokens(tiny_model, model_cache, tmp_path) -> None:
    recipe, config, options = setup("guess", model=tiny_model, cache_dir=model_cache)
    tok = load_tokenizer(tiny_model)
    symbols = recipe.datasets(config, options)[0].world.symbols
    assert symbols == {"start": tok.encode("?"), "lower": tok.encode("<"), "higher": tok.encode(">"),
                       "digits": [tok.convert_tokens_to_ids(str(d)) for d in range(10)]}
    outcome = train("guess", {"model": tiny_model, "cache_dir": model_cache, "steps": 1, "groups_per_batch": 2,
                              "group_size": 2, "max_turns": 2, "eval_every": 0, "sandboxes": 1,
                              "skip_constant_reward": False}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    (step,) = read_jsonl(outcome.metrics_path)
    assert step["attempts_failed"] == 0 and step["sampled_tokens_trained"] >= 4


def test_tools_fits_a_model_whose_template_writes_tools(tiny_model, model_cache) -> None:
    recipe, config, options = setup("tools", model=tiny_model, max_tokens=32, cache_dir=model_cache)
    world = recipe.datasets(config, options)[0].world
    assert (world.tool_parser, world.question) == ("hermes", QUESTION)
    assert recipe.engine_config(config, options).model == tiny_model
    with pytest.raises(ConfigurationError, match=r"^max_tokens=1: with model='.*' a turn is text"):
        recipe.datasets(*setup("tools", model=tiny_model, cache_dir=model_cache)[1:])


def test_tools_refuses_a_template_without_tools_and_a_model_without_template(tiny_model, model_cache,
                                                                            tmp_path) -> None:
    def plain_template(path: str) -> None:
        file = os.path.join(path, "tokenizer_config.json")
        with open(file) as f:
            cfg = json.load(f)
        cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        with open(file, "w") as f:
            json.dump(cfg, f)
        if os.path.exists(os.path.join(path, "chat_template.jinja")):
            os.remove(os.path.join(path, "chat_template.jinja"))

    plain = altered(tiny_model, tmp_path, plain_template)
    recipe, config, options = setup("tools", model=plain, max_tokens=32, cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match=f"^model={plain!r}: its chat template does not write the tools"):
        recipe.engine_config(config, options)
    char = prepare_char_model(ALPHABET, END, cache_dir=model_cache, seed=0, max_position_embeddings=64)
    recipe, config, options = setup("tools", model=char, max_tokens=32, cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match=f"^model={char!r}: has no chat template"):
        recipe.datasets(config, options)


def test_guess_refuses_a_model_without_digit_tokens(model_cache) -> None:
    letters = prepare_char_model("abc$", "$", cache_dir=model_cache)
    recipe, config, options = setup("guess", model=letters, cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match=f"^model={letters!r}: the digit 0 is not one token"):
        recipe.datasets(config, options)


def test_copy_refuses_a_short_context_and_a_short_answer(tiny_model, model_cache, tmp_path) -> None:
    def short_context(path: str) -> None:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            cfg = json.load(f)
        with open(file, "w") as f:
            json.dump({**cfg, "max_position_embeddings": 16}, f)

    short = altered(tiny_model, tmp_path, short_context)
    recipe, config, options = setup("copy", model=short, max_tokens=8, cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match=f"^model={short!r}: its context of 16 tokens cannot hold a copy "
                                                 r"prompt and max_tokens=8 \(\d+ tokens\)"):
        recipe.datasets(config, options)
    recipe, config, options = setup("copy", model=tiny_model, max_tokens=3, cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match="^max_tokens=3: .* answers 3 digits and its end token in 4 tokens"):
        recipe.datasets(config, options)


def test_a_model_without_tokenizer_or_at_a_bad_path_is_refused(tiny_model, model_cache, tmp_path) -> None:
    def no_tokenizer(path: str) -> None:
        for name in os.listdir(path):
            if name.startswith(("tokenizer", "chat_template", "special_tokens", "vocab", "merges")):
                os.remove(os.path.join(path, name))

    bare = altered(tiny_model, tmp_path, no_tokenizer)
    for recipe_name in ("copy", "guess", "tools"):
        recipe, config, options = setup(recipe_name, model=bare, max_tokens=1 if recipe_name == "guess" else 8,
                                        cache_dir=model_cache)
        with pytest.raises(ConfigurationError, match=f"^model={bare!r}: no tokenizer loads from"):
            recipe.engine_config(config, options)
    recipe, config, options = setup("copy", model="/nonexistent/model", cache_dir=model_cache)
    with pytest.raises(ConfigurationError, match="^model='/nonexistent/model': not 'tiny', a local model directory"):
        recipe.datasets(config, options)


def test_the_model_setting_is_checked_on_its_own() -> None:
    with pytest.raises(ConfigurationError, match="^model='': must be a model directory, a .gguf file or a hub id"):
        TrainConfig(model="")
    with pytest.raises(ConfigurationError, match="^model='m.gguf': backend='sim' runs no model"):
        TrainConfig(model="m.gguf", backend="sim")
    assert TrainConfig().model is None
