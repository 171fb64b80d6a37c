"""Model directories: the locally built ``tiny`` model, local HF directories, tokenizers, chat.

There is no model hub here. ``build_tiny`` creates a Qwen2-architecture
causal LM from a transformers config (random init) and a byte-level BPE
tokenizer trained on the spot with ``tokenizers`` on a generated corpus,
with a hand-written ChatML template, and saves both with ``save_pretrained``
so that ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` (or vLLM) load it offline.

``build_char_model`` builds the same architecture over a character
vocabulary of a dozen tokens (the built-in RL demo: a small vocabulary makes
the first rewarded sample common enough for RL from random init);
``prepare_char_model`` builds it once into the cache and returns its
directory, which ``EngineConfig(model=...)`` takes like any local model.

``prepare(config)`` resolves ``EngineConfig.model`` to a directory: ``"tiny"``
is built once into a cache directory keyed by its build parameters (built in
a temporary directory and renamed into place, so concurrent builders never
see or leave a half-written model); any other name goes through ``resolve``:

* a local directory holding a ``config.json`` is used as it is;
* a ``.gguf`` file is converted once, with transformers' GGUF loader (the
  ``gguf`` package, ``rlengine[gguf]``), into a Hugging Face directory in the
  cache keyed by the file's digest, so the backend (torch or vLLM) and the
  trainer load the same dequantized float32 weights and the same tokenizer;
* a hub id (``org/name``) is looked up in the local Hugging Face cache only;
  anything else is a ``ConfigurationError`` naming the value.

``describe(path)`` reads what a recipe checks before it starts: the context
length and the end-of-sequence tokens the backends stop at.

This module never reaches the network: every load passes
``local_files_only=True``. It does not run models; the backend and the
trainer do.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import uuid
from typing import Any, NamedTuple

from rlengine.config import TINY_DEFAULTS
from rlengine.errors import ConfigurationError

__all__ = ["CHAR_DEFAULTS", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_DEFAULTS", "ModelFacts", "build_char_model",
           "build_tiny", "cache_root", "describe", "load_tokenizer", "prepare", "prepare_char_model", "resolve",
           "tiny_dir_name"]

# The special tokens of the tiny tokenizer, with ids 0, 1, 2 (Qwen's names:
# vLLM and chat tooling recognise them).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2 uses it, with tools in the Hermes / Qwen2.5 layout: the
# tools' JSON schemas in the system turn, each assistant tool call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> after the turn's text,
# and consecutive tool results in one user turn of <tool_response> blocks. A
# message's reasoning_content, if any, is kept in <think> before its text. A
# generation prompt opens the assistant turn. Plain conversations render as
# plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] }}"
    "{%- if message.get('reasoning_content') %}"
    "{{- '\\n<think>\\n' + message['reasoning_content'] + '\\n</think>\\n' }}{%- endif %}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}"
    "{%- elif not message.get('tool_calls') %}{{- '\\n' }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split. The tiny tokenizer uses exactly Qwen2's
# normalizer and pre-tokenizer, because transformers 5 rebuilds a tokenizer
# whose config says ``model_type: qwen2`` through its own Qwen2Tokenizer
# pipeline: any other pipeline would encode differently once reloaded.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Bumped whenever build_tiny's output changes for the same parameters, so a
# cache built by an older rlengine is not reused.
_BUILD_FORMAT = 2


# -- the generated corpus and the tokenizer -------------------------------------------

_CONSONANTS = "bcdfghklmnprstvwz"
_VOWELS = "aeiou"
_ROLES = ("system", "user", "assistant")


def _corpus(seed: int) -> list[str]:
    """A few hundred KB of varied text: prose from invented words, arithmetic,
    key-value records and chat transcripts, so BPE learns words, digits,
    punctuation and the chat layout."""
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS] + list(_VOWELS)
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)})
    # A Zipf-like choice makes some words frequent enough to become tokens.
    cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(words))))

    def sentence() -> str:
        n = rng.randint(3, 14)
        return " ".join(rng.choices(words, cum_weights=cum_weights, k=n)).capitalize() + rng.choice(".....?!,;:")

    lines = []
    for _ in range(1500):
        lines.append(" ".join(sentence() for _ in range(rng.randint(1, 4))))
    for _ in range(1000):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        lines.append(rng.choice([f"{a}+{b}={a + b}", f"{a} - {b} = {a - b}", f"{a}*{b % 100}={a * (b % 100)}",
                                 f"({a}, {b})", f"[{a}, {b}, {a ^ b}]"]))
    for _ in range(600):
        key, value = rng.choice(words), rng.choice(words)
        lines.append(rng.choice([f'{{"{key}": "{value}", "n": {rng.randint(0, 999)}}}',
                                 f"{key} = {value}({rng.randint(0, 99)})", f"def {key}({value}):\n    return {value}",
                                 f"- {key}: {value}\n\n- {value}: {key}", f"<{key}>{value}</{key}>"]))
    for _ in range(600):
        turns = [(rng.choice(_ROLES), sentence()) for _ in range(rng.randint(1, 4))]
        lines.append("".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns))
    return lines


def _train_tokenizer(vocab_size: int, seed: int, max_length: int) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens, wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ConfigurationError(f"vocab_size={vocab_size}: the generated corpus yields only "
                                 f"{tok.get_vocab_size()} tokens; use model_vocab_size for a larger embedding")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=max_length, chat_template=CHAT_TEMPLATE)


def _write_tokenizer_config(path: str) -> None:
    """Name the tokenizer class and embed the chat template the way every
    transformers version (and vLLM) reads them, not only the one that saved it."""
    file = os.path.join(path, "tokenizer_config.json")
    with open(file, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["bos_token"] = None
    cfg.setdefault("add_prefix_space", False)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


# -- building ------------------------------------------------------------------------------

def _check_build_args(args: dict[str, Any]) -> None:
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_position_embeddings"):
        v = args[name]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigurationError(f"{name}={v!r}: must be a positive integer")
    if args["vocab_size"] < 300:
        raise ConfigurationError(f"vocab_size={args['vocab_size']}: must be >= 300 (256 bytes, specials, merges)")
    mv = args["model_vocab_size"]
    if mv is not None and (isinstance(mv, bool) or not isinstance(mv, int) or mv < args["vocab_size"]):
        raise ConfigurationError(f"model_vocab_size={mv!r}: must be None or an integer >= vocab_size "
                                 f"{args['vocab_size']}")
    if args["hidden_size"] % args["num_heads"]:
        raise ConfigurationError(f"hidden_size={args['hidden_size']}: must be a multiple of num_heads="
                                 f"{args['num_heads']}")
    head_dim = args["hidden_size"] // args["num_heads"]
    # vLLM's CPU attention kernels take head sizes 32..512; the tiny model
    # must run there too.
    if not 32 <= head_dim <= 512:
        raise ConfigurationError(f"hidden_size/num_heads={head_dim}: head_dim must be in 32..512")
    if args["num_heads"] % args["num_kv_heads"]:
        raise ConfigurationError(f"num_kv_heads={args['num_kv_heads']}: must divide num_heads={args['num_heads']}")
    if args["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ConfigurationError(f"dtype={args['dtype']!r}: must be float32, bfloat16 or float16")
    if not (isinstance(args["init_std"], (int, float)) and args["init_std"] > 0):
        raise ConfigurationError(f"init_std={args['init_std']!r}: must be a number > 0")


def build_tiny(path: str, **params: Any) -> str:
    """Build a random-init Qwen2 causal LM and its tokenizer into ``path``; returns ``path``.

    Parameters (defaults in ``TINY_DEFAULTS``): ``vocab_size`` (tokenizer and
    model), ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``intermediate_size``, ``max_position_embeddings``, ``tie_word_embeddings``,
    ``init_std`` (weight init std: 0.1 makes next-token distributions peaked
    enough that greedy text varies and top-k/top-p cut real mass),
    ``model_vocab_size`` (embedding rows, >= vocab_size, padded like Qwen's),
    ``dtype`` and ``seed``. The same parameters give the same files.
    """
    unknown = sorted(set(params) - set(TINY_DEFAULTS))
    if unknown:
        raise ConfigurationError(f"build_tiny: unknown parameter(s) {unknown}; known: {sorted(TINY_DEFAULTS)}")
    args = {**TINY_DEFAULTS, **params}
    _check_build_args(args)

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(args["vocab_size"], args["seed"], args["max_position_embeddings"])
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2Config(
        vocab_size=args["model_vocab_size"] or args["vocab_size"],
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        max_position_embeddings=args["max_position_embeddings"],
        tie_word_embeddings=args["tie_word_embeddings"],
        initializer_range=float(args["init_std"]),
        rope_theta=10000.0,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    dtype = getattr(torch, args["dtype"])
    # A private RNG stream: building a model must not move the caller's seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = Qwen2ForCausalLM(config)
    model.to(dtype)
    # A chat model ends its turn with <|im_end|>; plain text ends with <|endoftext|>.
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_tokenizer_config(path)
    with open(os.path.join(path, "rlengine_build.json"), "w", encoding="utf-8") as f:
        json.dump({"builder": "rlengine.backends.torch.models.build_tiny", "format": _BUILD_FORMAT, "params": args}, f,
                  indent=2, sort_keys=True)
    return path


def tiny_dir_name(**params: Any) -> str:
    """The cache directory name of a tiny build: a digest of its parameters."""
    args = {**TINY_DEFAULTS, **params}
    digest = hashlib.sha256(json.dumps({"format": _BUILD_FORMAT, **args}, sort_keys=True).encode()).hexdigest()
    return f"tiny-{digest[:16]}"


def cache_root(config: Any = None) -> str:
    """Where built models live: ``config.cache_dir``, else ``$RLENGINE_CACHE``, else ``~/.cache/rlengine``."""
    root = getattr(config, "cache_dir", None) or os.environ.get("RLENGINE_CACHE") \
        or os.path.join(os.path.expanduser("~"), ".cache", "rlengine")
    return os.path.abspath(root)


def _build_cached(root: str, **params: Any) -> str:
    """Build the tiny model once per parameter set; concurrent builders race harmlessly."""
    return _build_once(root, tiny_dir_name(**params), lambda path: build_tiny(path, **params))


def _build_once(root: str, name: str, build: Any) -> str:
    """``build(path)`` into ``root/models/name`` unless it is there already.

    Each builder writes a private temporary directory next to the target and
    renames it into place; ``rename`` is atomic, so the target either does not
    exist or is complete. A loser of the race discards its copy.
    """
    models_dir = os.path.join(root, "models")
    final = os.path.join(models_dir, name)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(models_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".build-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}-", dir=models_dir)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- the character-level model of the RL demo -------------------------------------------

CHAR_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 64,
    "init_std": 0.02,
    "seed": 0,
    "chat_template": None,
}
_CHAR_PAD = "<|endoftext|>"


def build_char_model(path: str, alphabet: str, end: str, **params: Any) -> str:
    """A random-init Qwen2 causal LM whose tokens are the characters of ``alphabet``.

    Token 0 is ``<|endoftext|>`` (padding, and what unknown characters map
    to); ``alphabet[i]`` is token ``i + 1``; ``end`` (a character of
    ``alphabet``) is the model's end-of-sequence token, so the engine stops a
    generation there. ``init_std`` 0.02 keeps the first distributions near
    uniform, which is what exploration from random init needs. Parameters
    (``CHAR_DEFAULTS``) as in ``build_tiny``, and ``chat_template`` (a Jinja
    chat template over the alphabet's characters; None: none); the same
    arguments give the same files.
    """
    unknown = sorted(set(params) - set(CHAR_DEFAULTS))
    if unknown:
        raise ConfigurationError(f"build_char_model: unknown parameter(s) {unknown}; known: {sorted(CHAR_DEFAULTS)}")
    args = {**CHAR_DEFAULTS, **params}
    if not isinstance(alphabet, str) or len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ConfigurationError(f"alphabet={alphabet!r}: must be a non-empty string of distinct characters")
    if len(end) != 1 or end not in alphabet:
        raise ConfigurationError(f"end={end!r}: must be one character of alphabet={alphabet!r}")
    template = args.pop("chat_template")
    if template is not None and not isinstance(template, str):
        raise ConfigurationError(f"chat_template={template!r}: must be a string or None")
    _check_build_args({**TINY_DEFAULTS, **args, "num_kv_heads": args["num_heads"], "vocab_size": 300})

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {tok: i for i, tok in enumerate([_CHAR_PAD, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_CHAR_PAD))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=end, pad_token=_CHAR_PAD,
                                        model_max_length=args["max_position_embeddings"])
    if template is not None:
        tokenizer.chat_template = template
    eos, pad = vocab[end], vocab[_CHAR_PAD]
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=args["hidden_size"], intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"], num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_heads"], max_position_embeddings=args["max_position_embeddings"],
        tie_word_embeddings=False, initializer_range=float(args["init_std"]), rope_theta=10000.0,
        use_sliding_window=False, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "rlengine_build.json"), "w", encoding="utf-8") as f:
        json.dump({"builder": "rlengine.backends.torch.models.build_char_model", "format": _BUILD_FORMAT,
                   "params": {**args, "alphabet": alphabet, "end": end, "chat_template": template}}, f, indent=2,
                  sort_keys=True)
    return path


def prepare_char_model(alphabet: str, end: str, cache_dir: str | None = None, **params: Any) -> str:
    """The directory of ``build_char_model(alphabet, end, **params)``, built once into the cache."""
    key = json.dumps({"format": _BUILD_FORMAT, "alphabet": alphabet, "end": end, **CHAR_DEFAULTS, **params},
                     sort_keys=True)
    name = f"char-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    root = cache_root(None) if cache_dir is None else os.path.abspath(cache_dir)
    return _build_once(root, name, lambda path: build_char_model(path, alphabet, end, **params))


def prepare(config: Any) -> str:
    """Resolve ``config.model`` to a local model directory (registry entry point)."""
    model = config.model
    if model == "tiny":
        return _build_cached(cache_root(config), **dict(getattr(config, "model_args", None) or {}))
    return resolve(model, cache_root(config))


# -- models given by path, GGUF file or hub id ---------------------------------------------

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A Hugging Face repo id, ``org/name`` (what is not an existing path and looks like this)."""


def resolve(model: str, root: str, field: str = "model") -> str:
    """``model`` (a Hugging Face directory, a ``.gguf`` file or a hub id in the local cache) as a
    local Hugging Face directory; GGUF files are converted once into ``root/models``. Errors name
    ``field`` and the value."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigurationError(f"{field}={model!r}: the directory has no config.json (not a Hugging Face "
                                     "model directory)")
        return os.path.abspath(model)
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigurationError(f"{field}={model!r}: no such GGUF file")
        return _convert_gguf(os.path.abspath(model), root, field)
    if _HUB_ID.fullmatch(model) and not os.path.exists(model):
        return _from_hub_cache(model, field)
    raise ConfigurationError(f"{field}={model!r}: not 'tiny', a local model directory, a .gguf file nor a hub id "
                             "('org/name') (no such directory; rlengine never downloads models)")


def _from_hub_cache(repo_id: str, field: str) -> str:
    """The snapshot of ``repo_id`` in the local Hugging Face cache; never a download."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:  # a base install: no transformers, so no model of any kind
        raise ConfigurationError(
            f"{field}={repo_id!r}: a hub id is read from the local Hugging Face cache (rlengine never downloads "
            f"models), which needs huggingface_hub ({exc}): pip install 'rlengine[torch]'") from None

    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ConfigurationError(
            f"{field}={repo_id!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); rlengine never "
            f"downloads models: fetch it once with `hf download {repo_id}` (or give a local directory or "
            ".gguf file)") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigurationError(f"{field}={repo_id!r}: its cached snapshot {path} has no config.json (not a "
                                 "transformers model; for a GGUF repo give the .gguf file's path)")
    return path


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(file: str, root: str, field: str) -> str:
    """The Hugging Face directory of a GGUF file, converted once per content (its sha256)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ConfigurationError(f"{field}={file!r}: reading a GGUF file needs the gguf package: "
                                 "pip install 'rlengine[gguf]'")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(file)[:-len(".gguf")])[:48]
    digest = _file_digest(file)
    return _build_once(root, f"gguf-{stem}-{digest[:16]}", lambda path: _gguf_to_hf(file, digest, path, field))


def _gguf_to_hf(file: str, digest: str, path: str, field: str) -> None:
    """Dequantize ``file`` with transformers into ``path`` (model, tokenizer, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, local_files_only=True,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as exc:
        raise ConfigurationError(f"{field}={file!r}: transformers cannot load this GGUF file: {exc}") from None
    # The loader dequantized every tensor to float32 but leaves the model marked as GGUF-quantized,
    # which save_pretrained refuses; what is saved is a plain float32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "rlengine_build.json"), "w", encoding="utf-8") as f:
        json.dump({"builder": "rlengine.backends.torch.models.resolve", "format": _BUILD_FORMAT,
                   "gguf_file": file, "sha256": digest}, f, indent=2, sort_keys=True)


class ModelFacts(NamedTuple):
    """What a recipe checks of a model directory before it starts."""

    context: int | None
    """``max_position_embeddings`` (what the torch backend and trainer take as the context); None: unknown."""
    eos_ids: frozenset[int]
    """The end-of-sequence tokens of ``config.json`` and ``generation_config.json`` (where the backends stop)."""


def describe(path: str) -> ModelFacts:
    """The context length and end tokens of the model directory ``path``, read from its json files."""
    ids: set[int] = set()
    context = None
    for name in ("config.json", "generation_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                cfg = json.load(f)
        except FileNotFoundError:
            continue
        eos = cfg.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else [int(e) for e in eos or ()])
        if name == "config.json":
            context = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return ModelFacts(int(context) if context else None, frozenset(ids))


# -- tokenizer ------------------------------------------------------------------

def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer of a model directory, loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
