"""The plumbing recipe (``rl_sim``) with a start-up of ``START_S`` seconds beside the engine.

``rlengine train``'s progress tests load it as ``cli_slow_start:RECIPE``: the time per
step it shows must be the steps' own, not start-up spread over the first steps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rl_sim import SimRecipe

START_S = 2.0


class SlowStart(SimRecipe):
    name = "slow-start"
    description = "the plumbing recipe, with a slow start-up"

    @contextlib.asynccontextmanager
    async def attach(self, engine: Any, dataset: Any, eval_dataset: Any) -> AsyncIterator[None]:
        await asyncio.sleep(START_S)
        yield


RECIPE = SlowStart()
