"""Training models of the Tinker API: one trainer per model, its request order, its weights snapshots.

A Tinker training client owns a model (``create_model``): here a trainer of
its own, a ``LoraTrainer`` for a LoRA rank or a ``TorchTrainer`` for full
fine-tuning (rank 0), over the engine's model directory. The trainer is
built on the engine's compute thread, as blocking work through the engine's
FIFO like every training call, so a model's calls run in the engine's
submission order with the sampler drained, exactly as in-process
``TrainingClient`` calls do.

The SDK numbers each model's calls (``seq_id`` 1, 2, ...) and may send the
chunks of one ``forward_backward`` concurrently; ``TrainingModel.order``
submits them to the engine strictly in ``seq_id`` order, holding early
arrivals (bounded, and failed after ``hold_timeout_s`` if the gap never
fills). A repeated ``seq_id`` (a retry whose first answer was lost) gets the
first request's id back instead of running twice. A call refused before it
was queued still takes its turn (``refuse``), or every later call of its
model would wait for it until ``hold_timeout_s``.

The trainer-kind helpers at the bottom take and merge snapshots of a
model's trainable state for the sampler (an adapter for LoRA, all weights
for full fine-tuning); they run on the compute thread. Everything else here
runs on the loop thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlengine.errors import InvalidRequest, ModelNotLoaded
from rlengine.tinker_api.errors import Gone, Overloaded

if TYPE_CHECKING:
    # The trainers import torch: only the compute-thread helpers below need them.
    from rlengine.trainer.lora import LoraSpec

__all__ = ["TrainingModel", "build_trainer", "snapshot_weights", "take_snapshot"]

_MAX_HELD = 4096
_SEEN_KEPT = 1024


class TrainingModel:
    """One Tinker training model: its trainer, owner, and the order of its calls."""

    def __init__(self, model_id: str, session_id: str, owner: str, base_model: str, lora: LoraSpec | None,
                 user_metadata: dict[str, Any] | None = None, first_seq: int = 1) -> None:
        self.model_id = model_id
        self.session_id = session_id
        self.owner = owner
        self.base_model = base_model
        self.lora = lora
        self.user_metadata = user_metadata or {}
        self.last_request = time.time()
        """Wall-clock time of the model's last call (its training run's ``last_request_time``)."""
        self.trainer: Any = None
        """Set on the compute thread by the creating call; None until then (or if it failed)."""
        self.failure: BaseException | None = None
        self.closed = False
        self.next_seq = first_seq
        self.snapshots_taken = 0
        self.named_snapshots: list[dict[str, Any]] = []
        """The in-memory state of snapshots also saved on disk (dropped when the model is unloaded)."""
        self._held: dict[int, tuple[float, Callable[[], None], Callable[[BaseException], None]]] = {}
        self._seen: OrderedDict[int, str] = OrderedDict()
        self._refused: OrderedDict[int, BaseException] = OrderedDict()
        """seq_id -> why a call was refused at submission (its retry is refused alike)."""

    @property
    def rank(self) -> int:
        return 0 if self.lora is None else self.lora.rank

    def require(self) -> Any:
        """The trainer (compute thread, inside a queued call): fails if creation failed or it was unloaded."""
        if self.closed:
            raise Gone("model_id", self.model_id, "the model was unloaded")
        if self.trainer is None:
            raise ModelNotLoaded(f"model {self.model_id} has no trainer: its creation failed "
                                 f"({self.failure!r})")
        return self.trainer

    # -- call order ---------------------------------------------------------------------

    def seen(self, seq_id: int | None) -> str | None:
        """The request id already given to ``seq_id`` (a retried call), if any; a retried call that was
        refused is refused again with the same error."""
        if seq_id is None:
            return None
        refused = self._refused.get(seq_id)
        if refused is not None:
            raise refused
        return self._seen.get(seq_id)

    def order(self, seq_id: int | None, request_id: str, start: Callable[[], None],
              fail: Callable[[BaseException], None]) -> None:
        """Run ``start()`` when every call before ``seq_id`` has started (now, if it is next)."""
        if self.closed:
            raise Gone("model_id", self.model_id, "the model was unloaded")
        seq = self.next_seq if seq_id is None else seq_id
        if not self._free(seq):
            raise InvalidRequest("seq_id", seq_id, f"already used for model {self.model_id} "
                                 f"(the next expected is {self.next_seq})")
        if seq != self.next_seq and len(self._held) >= _MAX_HELD:
            raise Overloaded("seq_id", seq_id, f"{len(self._held)} calls already wait for seq_id {self.next_seq}")
        self._seen[seq] = request_id
        while len(self._seen) > _SEEN_KEPT:
            self._seen.popitem(last=False)
        self._take(seq, start, fail)

    def refuse(self, seq_id: int | None, error: BaseException) -> None:
        """A call refused before it was queued still takes its turn, as a call that does nothing: the
        calls after it must not wait ``hold_timeout_s`` for it. A retry of it gets ``error`` again."""
        if self.closed or seq_id is None or not self._free(seq_id):
            return
        self._refused[seq_id] = error
        while len(self._refused) > _SEEN_KEPT:
            self._refused.popitem(last=False)
        self._take(seq_id, _nothing, _nothing)

    def _free(self, seq: object) -> bool:
        """Whether ``seq`` is a sequence number no call of this model has taken yet."""
        return not isinstance(seq, bool) and isinstance(seq, int) and seq >= self.next_seq \
            and seq not in self._held and seq not in self._seen and seq not in self._refused

    def _take(self, seq: int, start: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        if seq != self.next_seq:
            self._held[seq] = (time.monotonic(), start, fail)
            return
        # The turn is taken even if ``start`` raises (its caller reports that), and the calls it
        # releases each report their own failure: nothing may stop the sequence.
        self.next_seq += 1
        try:
            start()
        finally:
            while self.next_seq in self._held:
                _, held_start, held_fail = self._held.pop(self.next_seq)
                self.next_seq += 1
                try:
                    held_start()
                except Exception as exc:  # noqa: BLE001 - the held call's own failure, reported to it
                    held_fail(exc)

    def expire_held(self, hold_timeout_s: float) -> None:
        """Fail calls that waited ``hold_timeout_s`` for a ``seq_id`` that never came, and move past the gap."""
        if not self._held:
            return
        oldest = min(t for t, _, _ in self._held.values())
        if time.monotonic() - oldest < hold_timeout_s:
            return
        missing = self.next_seq
        held, self._held = sorted(self._held.items()), {}
        error = InvalidRequest("seq_id", missing, f"never arrived within hold_timeout_s={hold_timeout_s}; "
                               f"the calls after it fail")
        for _, (_, _, fail) in held:
            fail(error)
        self.next_seq = held[-1][0] + 1

    def close(self, reason: BaseException) -> None:
        """No more calls; calls still waiting for their turn fail with ``reason``."""
        self.closed = True
        held, self._held = list(self._held.values()), {}
        for _, _, fail in held:
            fail(reason)


def _nothing(*_args: object) -> None:
    """What a refused call runs when its turn comes."""


# -- compute thread: trainers and snapshots ------------------------------------------------


def build_trainer(config: Any, model_path: str | None, lora: LoraSpec | None) -> Any:
    """A LoRA trainer for ``lora``, else a full fine-tuning torch trainer, for the engine's model."""
    if lora is None:
        from rlengine.trainer.torch_trainer import build

        return build(config, model_path)
    from rlengine.trainer.lora import build as build_lora

    return build_lora(config, model_path, lora)


def take_snapshot(trainer: Any) -> dict[str, Any]:
    """A CPU copy of the trainable state: the adapter (LoRA) or every weight (full fine-tuning)."""
    from rlengine.trainer.lora import LoraTrainer

    if isinstance(trainer, LoraTrainer):
        return trainer.adapter_state()
    return {n: p.detach().to("cpu", copy=True) for n, p in trainer.named_params.items()}


def snapshot_weights(trainer: Any, state: dict[str, Any]) -> list[tuple[str, Any]]:
    """The sampler's full weights for a snapshot taken by ``take_snapshot``."""
    from rlengine.trainer.lora import LoraTrainer

    if isinstance(trainer, LoraTrainer):
        return trainer.sampler_weights(state)
    return list(state.items())
