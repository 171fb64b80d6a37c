"""Fixtures the Tinker API tests share: one torch engine and one checkpoint directory per module."""

from __future__ import annotations

import pytest

import rlengine as rle


@pytest.fixture(scope="module")
def engine(engine_config):
    with rle.Engine(engine_config("torch")) as eng:
        yield eng


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tinker-ckpt"))
