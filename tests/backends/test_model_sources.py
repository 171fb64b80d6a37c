"""Where a model comes from (``models.resolve``): a Hugging Face directory, a ``.gguf`` file, a hub id
from the local cache only; and the clear error for each bad form, naming the field and the value.

The GGUF file is written on the spot from the tiny model (tests/gguf_writer.py, with the ``gguf``
package): converting it back must give the tiny model's weights and token ids exactly, once per file
content, and the engine must sample from it what it samples from the tiny model.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from gguf_writer import write_gguf

import rlengine as rle
from rlengine.backends.torch.models import describe, load_tokenizer, resolve
from rlengine.errors import ConfigurationError

pytestmark = pytest.mark.model_plane

TEXT = "Hello world 12345 <|im_start|>user\nhi there<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_file(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_gguf(tiny_model, str(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"))


def test_a_directory_is_used_as_it_is(tiny_model: str, tmp_path) -> None:
    assert resolve(tiny_model, str(tmp_path)) == os.path.abspath(tiny_model)
    facts = describe(tiny_model)
    assert facts.context == 2048 and facts.eos_ids == {2, 0}  # <|im_end|>, and <|endoftext|> (generation config)


def test_a_gguf_file_converts_once_to_the_same_weights_and_tokens(tiny_model: str, gguf_file: str, tmp_path) -> None:
    from safetensors.numpy import load_file

    root = str(tmp_path / "cache")
    converted = resolve(gguf_file, root)
    assert converted.startswith(os.path.join(root, "models", "gguf-tiny-f32-"))
    want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (tiny_model, converted))
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(want[name], got[name], err_msg=name)
    assert load_tokenizer(converted).encode(TEXT) == load_tokenizer(tiny_model).encode(TEXT)
    assert describe(converted).context == 2048 and 2 in describe(converted).eos_ids
    # Once per content: the same file again is the same directory, not a second conversion.
    stamp = os.stat(os.path.join(converted, "model.safetensors")).st_mtime_ns
    assert resolve(gguf_file, root) == converted
    assert os.stat(os.path.join(converted, "model.safetensors")).st_mtime_ns == stamp


def test_the_engine_samples_a_gguf_model_as_the_model_it_came_from(tiny_model: str, gguf_file: str,
                                                                   model_cache: str) -> None:
    params = rle.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = rle.ModelInput.from_ints([5, 17, 300, 42])
    out = []
    for model in (tiny_model, gguf_file):
        with rle.Engine(rle.EngineConfig(model=model, backend="torch", cache_dir=model_cache)) as engine:
            out.append(engine.sampling_client().sample(prompt, 1, params).result(60).sequences[0])
    assert out[0].tokens == out[1].tokens
    np.testing.assert_array_equal(out[0].logprobs_array(), out[1].logprobs_array())


def test_a_hub_id_comes_from_the_local_cache_only(tiny_model: str, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigurationError) as err:
        resolve("someorg/absent-model", str(tmp_path))
    message = str(err.value)
    assert message.startswith("model='someorg/absent-model': not in the local Hugging Face cache")
    assert "hf download someorg/absent-model" in message and str(tmp_path / "hub") in message
    # The cache's own layout (what `hf download` leaves): refs/main names the snapshot.
    repo = tmp_path / "hub" / "models--someorg--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    assert resolve("someorg/tiny", str(tmp_path)) == str(repo / "snapshots" / "0123abc")


@pytest.mark.parametrize(("model", "says"), [
    ("/nonexistent/model-dir", "not 'tiny', a local model directory, a .gguf file nor a hub id"),
    ("/nonexistent/model.gguf", "no such GGUF file"),
    ("../../not a hub id", "not 'tiny', a local model directory, a .gguf file nor a hub id"),
])
def test_a_bad_model_is_refused_naming_it(model: str, says: str, tmp_path) -> None:
    with pytest.raises(ConfigurationError, match=f"^model={model!r}: {says}"):
        resolve(model, str(tmp_path))


def test_a_directory_without_config_and_a_broken_gguf_are_refused(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigurationError, match="empty': the directory has no config.json"):
        resolve(str(tmp_path / "empty"), str(tmp_path))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigurationError, match=f"^model={str(broken)!r}: transformers cannot load this GGUF"):
        resolve(str(broken), str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache" / "models") or not [
        d for d in os.listdir(tmp_path / "cache" / "models") if not d.startswith(".")]


def test_engine_config_names_every_form_when_model_is_empty() -> None:
    with pytest.raises(ConfigurationError, match="^model='': must be 'tiny', a local model directory, a .gguf file"):
        rle.EngineConfig(model="")
