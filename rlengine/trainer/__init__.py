"""Trainers: loss functions with Tinker semantics and the trainers behind ``TrainingClient``.

``losses`` validates batches and defines each loss elementwise; ``sim`` is the
numpy trainer of the sim model; ``torch_trainer`` trains a Hugging Face causal
LM (imported lazily: the control plane never imports torch). Trainers run on
the engine's compute thread only.
"""
