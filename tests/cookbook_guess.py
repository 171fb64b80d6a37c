"""A recipe whose environments are tinker-cookbook's own guess-the-number game, unchanged
(``tinker_cookbook.recipes.multiplayer_rl.guess_number``), on the tiny model with the
cookbook's ``role_colon`` renderer: ``rlengine train cookbook_guess:RECIPE``."""

from __future__ import annotations

from typing import Any, ClassVar

from rlengine.config import EngineConfig
from rlengine.rl.config import TrainConfig
from rlengine.rl.cookbook import from_cookbook
from rlengine.rl.recipes import Recipe


class CookbookGuess(Recipe):
    name = "cookbook_guess"
    description = "tinker-cookbook's guess-the-number environment, unchanged"
    defaults: ClassVar[dict[str, Any]] = {"groups_per_batch": 2, "group_size": 4, "max_tokens": 8, "max_turns": 10,
                                          "backend": "torch", "learning_rate": 1e-3}

    def engine_config(self, config: TrainConfig, options: Any) -> EngineConfig:
        return EngineConfig(model="tiny", backend=config.backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: Any) -> tuple[Any, None]:
        from tinker_cookbook.recipes.multiplayer_rl.guess_number.env import GuessNumberDataset
        from tinker_cookbook.renderers import get_renderer
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        from rlengine.backends.torch.models import prepare

        tokenizer = get_tokenizer(prepare(self.engine_config(config, options)))  # a local directory: no hub
        dataset = GuessNumberDataset(answers=list(range(1, 1024)), renderer=get_renderer("role_colon", tokenizer),
                                     batch_size=config.groups_per_batch, group_size=config.group_size)
        return from_cookbook(dataset), None


RECIPE = CookbookGuess()
