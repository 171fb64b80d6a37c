"""rlengine.tinker_api: the Tinker REST API, so the official ``tinker`` SDK and the Tinker cookbook drive a local engine.

One role per module:

* ``server``     - ``start`` / ``start_async`` / ``TinkerServer``: HTTP (aiohttp) on the engine's own loop;
* ``service``    - ``TinkerService``: the API's semantics over an ``Engine``, assembled from the parts below
  (and itself answering sessions, discovery, creating and unloading models);
* ``registry``   - sessions, models, sampling sessions and checkpoints by id, and which API key owns each;
* ``training_calls`` - the calls on a training model: forward/backward, optimizer steps, saving and loading weights;
* ``sampling_calls`` - the calls of sampling sessions: creating and joining one, ``asample``;
* ``results``    - rendering results, relaying engine futures, retrieving and cancelling futures;
* ``runs``       - the REST listings of training runs and checkpoints, and deleting checkpoints;
* ``training``   - a training model's trainer, its call order by ``seq_id``, weight snapshots;
* ``sampling``   - sampler snapshots, installing them on demand, sampling sessions;
* ``futures``    - the bounded, expiring futures table and ``retrieve_futures`` completion logs;
* ``checkpoints`` - ``tinker://`` paths and checkpoint directories on local disk;
* ``wire`` / ``proto`` - the JSON and protobuf bodies of the Tinker wire;
* ``errors``     - typed errors and how each is reported;
* ``config``     - ``TinkerServerConfig``;
* ``__main__``   - ``python -m rlengine.tinker_api``: an engine and this server, until a signal.

LoRA training (``create_lora_training_client``) uses ``rlengine.trainer.lora``.
Names load on first use, so importing this package pulls in neither aiohttp nor the engine.
"""

from typing import Any

__all__ = ["TinkerServer", "TinkerServerConfig", "TinkerService", "start", "start_async"]

_FROM = {"TinkerServer": "server", "start": "server", "start_async": "server", "TinkerServerConfig": "config",
         "TinkerService": "service"}


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'rlengine.tinker_api' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"rlengine.tinker_api.{module}"), name)
