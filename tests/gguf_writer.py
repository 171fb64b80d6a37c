"""Write a GGUF file from a Qwen2 Hugging Face directory (the tiny model) with the ``gguf`` package.

For the tests of ``model=`` with a ``.gguf`` file: a small file the tests
make on the spot instead of downloading one. Float32 tensors (no
quantization, so the conversion back is exact), the tensor names of
``gguf``'s own name map for Qwen2, and the tokenizer as GGUF describes a
byte-level BPE one (``gpt2`` with the ``qwen2`` pre-tokenizer: the split the
tiny tokenizer uses), its special tokens marked as control tokens, and the
chat template. transformers' GGUF loader reads it back to the same weights
and the same token ids (tests/backends/test_model_sources.py checks both).
"""

from __future__ import annotations

import json
import os

import numpy as np

CONTROL, NORMAL = 3, 1
"""GGUF token types."""


def _json(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name), encoding="utf-8") as f:
        return json.load(f)


def write_gguf(model_dir: str, path: str) -> str:
    """``model_dir`` (a Qwen2 directory with ``tokenizer.json``) as the GGUF file ``path``; returns ``path``."""
    import gguf
    from safetensors.numpy import load_file

    cfg = _json(model_dir, "config.json")
    tok = _json(model_dir, "tokenizer.json")
    chat_template = _json(model_dir, "tokenizer_config.json").get("chat_template")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    if chat_template:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg["num_hidden_layers"])
    for name, array in load_file(os.path.join(model_dir, "model.safetensors")).items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
