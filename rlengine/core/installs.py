"""Weight installs through the install gate, and what keeps the gate from installing.

A weight install is blocking work (``Engine.submit_blocking``) that passes the
scheduler's install gate (``rlengine.core.scheduler``): admission is sealed,
the sampler drained (or paused), the weights loaded on the compute thread as
the next policy version, and the gate reopened at that version. With a training lane
(``EngineConfig.train_concurrently``) the weights are first copied where
training runs, after the training calls queued before the install. An
unload is the same item with nothing loaded after it.

A sample whose client went away mid-generation has an unknown outcome: its
lease stays unknown and poisons the gate (no install) until it is written
off (``abandon``, ``write_off``).

``WeightInstalls`` is a part of ``Engine`` (``rlengine.core.engine``), which
holds the state; its one job is the above. It imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlengine.backends import Backend
from rlengine.core.futures import RequestFuture
from rlengine.core.training import TrainingLane, snapshot
from rlengine.types import UnloadModelResponse

__all__ = ["WeightInstalls"]


class WeightInstalls:
    """Weight installs, unloads and the scheduler's unknown leases of an ``Engine``; see the module docstring."""

    # The engine's state this part uses (``Engine.__init__`` makes it).
    backend: Backend
    _lane: TrainingLane | None
    _next_version: int

    def install_weights(self, weights: Callable[[], Any]) -> RequestFuture[int]:
        """Install ``weights()`` (named tensors, taken where training runs) as the next policy
        version, through the gate: seal, drain, install, reopen. With a training lane the
        weights are copied there first, after the training calls queued before this install,
        then installed on the compute thread."""
        if self._lane is None:
            return self._install(weights)
        taken = self.submit_training("weights", lambda: snapshot(weights()))
        out: RequestFuture[int] = RequestFuture(taken.request_id)

        def install(f: RequestFuture[Any]) -> None:
            error = f.exception(0)
            if error is not None:
                out.set_exception(error)
            else:
                copy = f.result(0)
                out.adopt(self._install(lambda: copy))

        taken.add_done_callback(install)
        return out

    def _install(self, weights: Callable[[], Any]) -> RequestFuture[int]:
        box: dict[str, int] = {}

        def before() -> None:
            self._started().check_installable()
            box["version"] = self._next_version

        def run() -> int:
            version = box["version"]
            self.backend.load_weights(weights(), version)
            return version

        def after(version: int) -> int:
            self._started().install_version(version)
            self._next_version = version + 1
            return version

        return self.submit_blocking("install", run, before=before, after=after)

    def unload(self) -> RequestFuture[UnloadModelResponse]:
        """Unload the sampler's model; later samples fail with ``ModelNotLoaded``
        until the next weight install. A no-op (nothing loaded) does not drain."""

        def run() -> bool:
            if self.backend.capabilities.sleep:
                self.backend.sleep(2)
            return True

        def after(_: bool) -> UnloadModelResponse:
            sampler = self._started()
            if sampler.version is None:
                return UnloadModelResponse(unloaded=False)
            sampler.install_version(None)
            return UnloadModelResponse(unloaded=True)

        def noop() -> bool:
            return self._started().version is None

        return self.submit_blocking("unload", run, noop=noop, after=after)

    def abandon(self, request_id: str, reason: str) -> RequestFuture[int | None]:
        """Abort a sample whose client went away mid-generation: its outcome is
        unknown, so its lease (if admitted) stays unknown and poisons the gate
        until ``write_off``. Resolves to that lease id, or None if the request
        had not started or had already settled (then nothing is poisoned)."""
        return self.call_on_loop(self._started().abandon, request_id, reason)

    def write_off(self, lease_id: int) -> RequestFuture[Any]:
        """Give up on a lease with an unknown outcome (un-poisons the gate for it)."""
        return self.call_on_loop(self._started().write_off, lease_id)
