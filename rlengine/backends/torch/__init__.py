"""The PyTorch backend and the model code that goes with it.

* ``backend``  - ``TorchBackend``: continuous batching on the compute thread;
* ``decoder``  - batched prefill and decode over an HF causal LM, with its own KV cache;
* ``prefix_cache`` - the radix tree of prefix KV the backend reuses across requests;
* ``sampling`` - per-request sampling and stop detection;
* ``runtime``  - torch threads, device, dtype and model loading (shared with
  the torch trainer);
* ``models``   - model directories: the locally built ``tiny`` and character
  models, local HF directories, tokenizers (no torch at import).

Importing this package imports nothing heavy; ``runtime``, ``backend``,
``decoder``, ``prefix_cache`` and ``sampling`` import torch.
"""
