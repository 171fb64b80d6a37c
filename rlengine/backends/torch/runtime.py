"""Torch settings shared by the torch backend and the torch trainer: threads, device, dtype, model loading.

Threads: ``configure_threads`` applies the one thread decision
(``rlengine.backends.torch.threads``) to the calling thread; the engine
calls it on its compute thread, where every torch op of the engine runs
(the setting is per thread under OpenMP).

Device: CUDA when available, else CPU; ``EngineConfig.engine_args["device"]``
overrides. Dtype: ``EngineConfig.dtype``.

This module imports torch; nothing on the control plane may import it.
"""

from __future__ import annotations

from typing import Any

import torch

from rlengine.backends.torch.speculative import DEFAULT_K, MAX_K, SPECULATIVE_MODES
from rlengine.backends.torch.threads import decide, per_thread
from rlengine.errors import ConfigurationError

__all__ = ["ENGINE_ARGS", "PREFIX_CACHE_BYTES", "SUPPORTED_ARCHITECTURES", "configure_threads", "engine_args",
           "load_causal_lm", "pick_device", "threads_share", "torch_dtype"]

# Architectures whose decoder layers the torch backend runs itself (Llama-style
# attention: q/k/v/o projections, RoPE, RMSNorm, gated MLP; Qwen3 adds q/k norms).
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")

PREFIX_CACHE_BYTES = 256 * 2**20
"""The torch backend's default prefix cache budget: on the CPU, thousands of tokens' KV of a
small model (a 0.5B Qwen2 in bfloat16 holds 12 KB per token: about 21,000 tokens)."""

ENGINE_ARGS: dict[str, object] = {
    "device": None,
    "prefill_tokens": 8192,
    "micro_batch_tokens": 8192,
    "batch_invariant": False,
    "tree_min_prefix": 64,
    "prefix_cache_bytes": PREFIX_CACHE_BYTES,
    "speculative": None,
    "speculative_k": DEFAULT_K,
}
"""``EngineConfig.engine_args`` understood by the torch backend and trainer, with defaults:
``device`` (None: CUDA if available, else CPU); ``prefill_tokens``, the padded
prompt tokens one prefill batch may hold (at least one whole prompt always
fits); ``micro_batch_tokens``, the padded tokens per trainer forward pass
(packed tokens in a tree batch); ``batch_invariant``, a sequence's tokens and
logprobs bitwise independent of what shares its batches (``decoder``; slower),
which multi-turn runs need to be reproducible from their seed;
``tree_min_prefix``, the trainer's tree batches: datums of a call sharing at
least this many leading tokens are packed as a tree, each shared prefix
computed once (``rlengine.trainer.tree``); 0 turns them off;
``prefix_cache_bytes``, the memory the torch backend's prefix cache may hold
(KV of prompts and conversations it has computed, reused by requests that
start with them; 0 turns it off; ``backends.torch.prefix_cache``);
``speculative``, ``"ngram"`` for exact speculative decoding with drafts from each
request's own context (None: off; ``backends.torch.speculative``), and
``speculative_k``, the most tokens a request drafts per step."""


def configure_threads(share: int = 1) -> int:
    """Apply the thread decision (``threads.decide``) to the calling thread; returns the count in force.

    ``share``: how many compute threads run torch at once (2 when training runs beside sampling,
    ``EngineConfig.train_concurrently``); a decided count is split between them, so together they
    never oversubscribe the machine. An explicit ``RLENGINE_TORCH_THREADS`` is per thread."""
    threads = per_thread(decide(), share, torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def threads_share(config: Any) -> int:
    """The compute threads that run torch at once under ``config``: 2 when training runs beside
    sampling (``EngineConfig.train_concurrently``), else 1."""
    return 1 if getattr(config, "train_concurrently", "off") == "off" else 2


def engine_args(config: Any) -> dict[str, Any]:
    """``EngineConfig.engine_args`` for the torch backend and trainer, validated, defaults filled in."""
    given = dict(config.engine_args or {})
    unknown = sorted(set(given) - set(ENGINE_ARGS))
    if unknown:
        raise ConfigurationError(f"engine_args {unknown}: not options of the torch backend "
                                 f"(known: {', '.join(ENGINE_ARGS)})")
    args = {**ENGINE_ARGS, **given}
    for name in ("prefill_tokens", "micro_batch_tokens"):
        v = args[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigurationError(f"engine_args[{name!r}]={v!r}: must be an integer >= 1")
    v = args["tree_min_prefix"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigurationError(f"engine_args['tree_min_prefix']={v!r}: must be an integer >= 0 (0: off)")
    v = args["prefix_cache_bytes"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigurationError(f"engine_args['prefix_cache_bytes']={v!r}: must be an integer >= 0")
    if args["speculative"] not in SPECULATIVE_MODES:
        raise ConfigurationError(f"engine_args['speculative']={args['speculative']!r}: must be one of "
                                 f"{', '.join(map(repr, SPECULATIVE_MODES))}")
    v = args["speculative_k"]
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_K:
        raise ConfigurationError(f"engine_args['speculative_k']={v!r}: must be an integer in [1, {MAX_K}]")
    if not isinstance(args["batch_invariant"], bool):
        raise ConfigurationError(f"engine_args['batch_invariant']={args['batch_invariant']!r}: must be true or false")
    return args


def pick_device(config: Any) -> torch.device:
    """``engine_args["device"]`` if given, else CUDA when available, else CPU."""
    wanted = (config.engine_args or {}).get("device")
    if wanted is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(wanted)
    except (RuntimeError, TypeError):
        raise ConfigurationError(f"engine_args['device']={wanted!r}: not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"engine_args['device']={wanted!r}: CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"engine_args['device']={wanted!r}: the torch backend runs on cpu or cuda")
    return device


def torch_dtype(config: Any) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]


def load_causal_lm(model_path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """An HF causal LM from a local directory, offline, on ``device`` in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ConfigurationError(f"model={model_path!r}: architecture {archs or 'unknown'} is not supported by "
                                 f"the torch backend (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in (
            getattr(hf_config, "layer_types", None) or ()):
        raise ConfigurationError(f"model={model_path!r}: sliding-window attention is not supported by the "
                                 "torch backend")
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=dtype)
    return model.to(device=device, dtype=dtype)
