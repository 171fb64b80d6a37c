"""rlengine.core: the engine, its sampler loop and its scheduler (admission, leases, the install gate).

One role per module, each the single owner of its per-request records:

* ``engine``    - ``Engine``: its state and read-outs, made of three parts:
  ``lifecycle`` (start, close, threads), ``submission`` (the one validated
  submission path, ``Engine.sample``, and the thread-safe hand-in) and
  ``installs`` (weight installs through the install gate); it talks to the sampler only;
* ``sampler``   - ``SamplerLoop``: changes and settles every request from
  submission to settlement, steps the backend on the compute thread;
* ``records``   - the per-request records it owns (sample calls and their
  sequences, external leases, blocking work) and their constructors;
* ``scheduler`` - ``Scheduler``: the FIFO's admission rule, the lease
  ledger and the install gate (seal, drain, install, reopen); it owns every ``Lease``;
* ``compute``   - the one compute thread (data plane);
* ``futures``   - ``RequestFuture``, what a caller holds per request;
* ``config``    - ``EngineConfig`` and ``SimConfig``;
* ``api_keys``  - the API key a loopback HTTP or Tinker server draws, and its 0600 file;
* ``hangs``     - the hang watch: a dump of every thread, request and call when nothing
  progresses (or on SIGUSR1), read from the engines' counters and snapshots;
* ``clients``   - the in-process Tinker-style clients (``SamplingClient``,
  ``TrainingClient``), thin wrappers over ``Engine``.

Nothing here imports torch, transformers or vLLM at module level: backends
and trainers load through the registry (``rlengine.backends``) when used.
"""
