"""``rlengine.backends.torch.models``: the locally built tiny model, the model cache, tokenizers.

References: transformers' own loaders (``AutoModelForCausalLM``,
``AutoTokenizer``) and the raw ``tokenizers`` file. Chat rendering has its
own tests (``tests/test_render.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from safetensors.numpy import load_file

from rlengine.backends.torch import models
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError

SMALL = {"vocab_size": 320, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
         "num_layers": 1, "max_position_embeddings": 64}
"""Build parameters of a throwaway model (fast to build) for the build tests."""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_tiny_model_loads_offline_with_transformers(tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model, local_files_only=True)
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM's CPU attention needs head_dim >= 32
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention is exercised
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert len(tok) == cfg.vocab_size == models.TINY_DEFAULTS["vocab_size"]
    assert model.dtype == torch.float32
    assert [tok.convert_tokens_to_ids(t) for t in models.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert set(model.generation_config.eos_token_id) == {tok.eos_token_id, tok.pad_token_id}
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_and_matches_its_raw_file(tiny_model):
    from tokenizers import Tokenizer

    tok = models.load_tokenizer(tiny_model)
    raw = Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
    texts = ["Kalo mi ne 12+345=357.", "héllo wörld — ünïcödé 😀\n\n\ttabs  and   spaces",
             '{"key": [1, 2, 3]}\ndef f(x):\n    return x', "<|im_start|>user\nhi<|im_end|>\n", "a" * 200]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # transformers may rebuild a qwen2 tokenizer through its own pipeline;
        # it must encode exactly as the trained tokenizer file does.
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert max(ids) < len(tok)


@pytest.mark.model_plane
def test_build_is_deterministic_and_seeded(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    models.build_tiny(a, **SMALL)
    models.build_tiny(b, **SMALL)
    models.build_tiny(c, **SMALL, seed=1)
    assert _read(os.path.join(a, "tokenizer.json")) == _read(os.path.join(b, "tokenizer.json"))
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert any((wa[k] != wc[k]).any() for k in wa if k.endswith("proj.weight"))


@pytest.mark.model_plane
def test_build_does_not_move_the_callers_torch_seed(tmp_path):
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build_tiny(str(tmp_path / "m"), **SMALL)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("params, field", [
    ({"num_heads": 4}, "head_dim"),  # 64 / 4 = 16 < 32
    ({"num_kv_heads": 3, "num_heads": 2}, "num_kv_heads"),
    ({"vocab_size": 100}, "vocab_size"),
    ({"vocab_size": 100_000}, "model_vocab_size"),  # the corpus has fewer merges; the message says what to use
    ({"model_vocab_size": 10}, "model_vocab_size"),
    ({"layers": 2}, "unknown parameter"),
    ({"dtype": "int8"}, "dtype"),
])
@pytest.mark.model_plane
def test_build_rejects_bad_parameters(tmp_path, params, field):
    with pytest.raises(ConfigurationError, match=field):
        models.build_tiny(str(tmp_path / "m"), **{**SMALL, **params})


@pytest.mark.model_plane
def test_model_vocab_can_exceed_the_tokenizer(tmp_path):
    from transformers import AutoConfig

    path = models.build_tiny(str(tmp_path / "m"), **SMALL, model_vocab_size=384)
    assert AutoConfig.from_pretrained(path, local_files_only=True).vocab_size == 384
    assert len(models.load_tokenizer(path)) == SMALL["vocab_size"]


def test_prepare_builds_tiny_once_into_the_cache(tiny_model, model_cache):
    assert tiny_model == os.path.join(model_cache, "models", models.tiny_dir_name())
    stamp = os.stat(os.path.join(tiny_model, "model.safetensors")).st_mtime_ns
    again = models.prepare(EngineConfig(model="tiny", cache_dir=model_cache))
    assert again == tiny_model
    assert os.stat(os.path.join(tiny_model, "model.safetensors")).st_mtime_ns == stamp
    leftovers = [n for n in os.listdir(os.path.join(model_cache, "models")) if n.startswith(".build-")]
    assert leftovers == []
    with open(os.path.join(tiny_model, "rlengine_build.json"), encoding="utf-8") as f:
        assert json.load(f)["params"] == models.TINY_DEFAULTS


@pytest.mark.model_plane
def test_model_args_build_a_tiny_model_with_a_longer_context(tmp_path):
    """``EngineConfig.model_args`` are the tiny build's parameters: a context long enough for an
    agent's prompt is a setting, built once into the cache under its own name."""
    config = EngineConfig(model="tiny", cache_dir=str(tmp_path), model_args={**SMALL, "max_position_embeddings": 8192})
    path = models.prepare(config)
    assert os.path.basename(path) == models.tiny_dir_name(**{**SMALL, "max_position_embeddings": 8192})
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["max_position_embeddings"] == 8192
    assert models.prepare(config) == path  # built once


@pytest.mark.parametrize("kwargs, match", [
    ({"model_args": {"max_positions": 8192}}, "max_positions"),
    ({"model": "/some/local/model", "model_args": {"max_position_embeddings": 8192}}, "model_args"),
])
def test_model_args_are_checked_when_the_config_is_made(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        EngineConfig(**kwargs)


def test_cache_dir_name_is_keyed_by_build_parameters():
    assert models.tiny_dir_name() == models.tiny_dir_name(**models.TINY_DEFAULTS)
    assert models.tiny_dir_name(seed=1) != models.tiny_dir_name()
    assert models.tiny_dir_name(hidden_size=256) != models.tiny_dir_name()


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RLENGINE_CACHE", raising=False)
    assert models.cache_root(EngineConfig()) == str(tmp_path / "home" / ".cache" / "rlengine")
    monkeypatch.setenv("RLENGINE_CACHE", str(tmp_path / "env"))
    assert models.cache_root(EngineConfig()) == str(tmp_path / "env")
    assert models.cache_root(EngineConfig(cache_dir=str(tmp_path / "cfg"))) == str(tmp_path / "cfg")


@pytest.mark.model_plane
def test_a_builder_that_loses_the_race_keeps_the_winners_model(tmp_path, monkeypatch):
    """Another builder renames its copy into place while we build: ours is discarded, theirs kept."""
    root = str(tmp_path)
    winner = models._build_cached(root, **SMALL)
    winner_bytes = _read(os.path.join(winner, "model.safetensors"))
    os.rename(winner, winner + ".aside")
    real_build = models.build_tiny

    def build_while_another_finishes(path, **params):
        real_build(path, **{**params, "seed": 99})  # different bytes: must not win
        os.rename(winner + ".aside", winner)
        return path

    monkeypatch.setattr(models, "build_tiny", build_while_another_finishes)
    assert models._build_cached(root, **SMALL) == winner
    assert _read(os.path.join(winner, "model.safetensors")) == winner_bytes
    assert sorted(os.listdir(os.path.join(root, "models"))) == [os.path.basename(winner)]


@pytest.mark.model_plane
@pytest.mark.slow
def test_concurrent_builders_in_separate_processes(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from rlengine.backends.torch import models
        print(models._build_cached(sys.argv[1], **{SMALL!r}))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    path = paths.pop()
    assert sorted(os.listdir(os.path.join(str(tmp_path), "models"))) == [os.path.basename(path)]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def test_prepare_uses_a_local_model_directory_as_is(tmp_path, tiny_model):
    assert models.prepare(EngineConfig(model=tiny_model)) == tiny_model
    rel = os.path.relpath(tiny_model)
    assert models.prepare(EngineConfig(model=rel)) == os.path.abspath(rel)


@pytest.mark.parametrize("make, match", [
    (lambda d: str(d), "no config.json"),
    (lambda d: "Qwen/Qwen2.5-0.5B", "never downloads"),
    (lambda d: str(d / "missing"), "no such directory"),
])
def test_prepare_rejects_what_is_not_a_local_model(tmp_path, make, match):
    with pytest.raises(ConfigurationError, match=match) as info:
        models.prepare(EngineConfig(model=make(tmp_path)))
    assert "model=" in str(info.value)
