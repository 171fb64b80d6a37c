"""Runs tinker-cookbook 0.6.1's ``decisions`` recipe (its sampling path) against a local Tinker server.

``python decisions061_driver.py URL MODEL OUT_JSON`` with tinker-cookbook 0.6.1 first on
``PYTHONPATH`` and ``TINKER_API_KEY`` set (``test_tinker_prompt_targets``). The recipe's own
``DecisionRenderer`` and ``sample_decision`` run unchanged; only what needs a hub is replaced: the
renderer is ``role_colon`` over the local tiny model's tokenizer (the recipe's README uses Inkling's
``tml_v0``, whose tml-renderers>=0.4.1 pin is not on the index). The decisions are asked all at once
(``asyncio.gather``, as the recipe's docstring batches them), one with every id A..Z the
``PrefixedChoiceRenderer`` allows. OUT_JSON gets, per decision, the rendered tokens, the answer
position, each label's token and the probability ``sample_decision`` returned for it.
"""

from __future__ import annotations

import asyncio
import json
import string
import sys

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer, sample_decision
from tinker_cookbook.tokenizer_utils import get_tokenizer

DECISIONS = [
    Decision("A user asked: How do I build a decision model with Tinker Cookbook?\n\nWhich team should answer it?",
             [("billing", "Charges, invoices and payments"), ("sdk", "The tinker Python package"),
              ("cookbook", "The Tinker Cookbook"), ("console", "The web console")]),
    Decision("Will it rain tomorrow?", [("yes", ""), ("no", "")]),
    Decision("Pick a letter.", [(f"letter {c}", "") for c in string.ascii_uppercase]),
]


async def run(url: str, model: str) -> list[dict]:
    client = tinker.ServiceClient(base_url=url)
    sampling_client = await client.create_sampling_client(base_model="tiny")
    decision_renderer = DecisionRenderer(renderers.get_renderer("role_colon", get_tokenizer(model)))
    renderings = [decision_renderer.render(d) for d in DECISIONS]
    probabilities = await asyncio.gather(*(sample_decision(sampling_client, r) for r in renderings))
    return [{"tokens": r.tokens, "choice_pos": r.choice_pos, "label_tokens": r.label_tokens, "probabilities": p}
            for r, p in zip(renderings, probabilities, strict=True)]


def main() -> None:
    url, model, out = sys.argv[1:]
    results = asyncio.run(run(url, model))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
