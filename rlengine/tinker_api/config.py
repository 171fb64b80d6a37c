"""``TinkerServerConfig``: how the Tinker API server listens, authenticates and bounds its tables.

A frozen msgspec Struct whose fields declare their limits
(``rlengine.validation``); a bad value raises ``ConfigurationError`` naming
the field and the value. Every request carries an API key:
``api_key`` (a shared secret), or by default one the server draws when it
starts and writes to a 0600 file, since other users of a shared machine
reach loopback too. ``no_auth`` accepts any key (each key then owns its own
sessions), on loopback only; binding anything else needs ``api_key``. This
module holds settings only.
"""

from __future__ import annotations

import msgspec

from rlengine.core.api_keys import check_auth
from rlengine.errors import ConfigurationError
from rlengine.validation import Port, PositiveFloat, PositiveInt, validate

__all__ = ["TinkerServerConfig"]


class TinkerServerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Settings of the Tinker API server (every field has a working default)."""

    host: str = "127.0.0.1"
    port: Port = 0
    """0: any free port (the chosen one is in ``TinkerServer.url``)."""
    api_key: str | None = None
    """Shared secret every request must carry as ``X-API-Key`` (what the SDK sends from
    ``TINKER_API_KEY``; it must start ``tml-`` for the SDK). None: the server draws one
    (``tml-...``) when it starts (``TinkerServer.api_key``) and writes it to ``TinkerServer.key_file``,
    unless ``no_auth``."""
    no_auth: bool = False
    """Accept any key, each caller owning what its key created: on loopback only (every user of this
    machine can then connect)."""
    key_file: str | None = None
    """Where a drawn key is written (mode 0600, removed on close); None: ``tinker-<port>.key`` in
    ``$XDG_RUNTIME_DIR/rlengine``, else in ``~/.rlengine/run`` (mode 0700)."""
    checkpoint_dir: str | None = None
    """Where ``save_state`` / named ``save_weights_for_sampler`` write; None:
    ``<rlengine cache>/tinker-checkpoints``."""
    max_body_bytes: PositiveInt = 64 << 20
    poll_timeout_s: PositiveFloat = 20.0
    """Longest a ``retrieve_future(s)`` call waits before answering try-again (the SDK's own timeout is 45 s)."""
    future_ttl_s: PositiveFloat = 900.0
    """How long a settled result waits to be retrieved before it expires."""
    max_futures: PositiveInt = 100_000
    """Requests held in the futures table; beyond it (all still in flight) new calls get 429."""
    session_ttl_s: PositiveFloat = 300.0
    """A session with no heartbeat for this long is finished and its models unloaded (the SDK beats every 10 s)."""
    hold_timeout_s: PositiveFloat = 300.0
    """How long a call waits for an earlier ``seq_id`` of its model before it fails."""
    max_models: PositiveInt = 4
    """Training models alive at once (each holds its own trainer and optimizer state). A creation that finds
    them all taken evicts the model of a session silent for ``evict_after_s``, else waits up to that long for
    a slot to free, then fails."""
    evict_after_s: PositiveFloat = 30.0
    """A model whose session has sent nothing (no heartbeat, no call) for this long gives its slot to a new
    model when all ``max_models`` are taken: its client most likely exited without ``close()`` (the SDK beats
    every 10 s while it runs)."""
    sampler_snapshots_kept: PositiveInt = 8
    """Sampler weight snapshots kept in memory (a LoRA adapter each, or a full copy for rank 0)."""
    max_recorded_sequences: PositiveInt = 65_536
    """Sampled sequences remembered by ``sequence_id`` (``stability``: the provenance spans of training datums
    are checked against them, and ``stable_reinforce`` reads their behaviour logprobs); the least recently
    used go first, and naming one after that is ``Gone``. A cookbook step of 128 prompts x 16 samples is 2,048."""
    max_recorded_bytes: PositiveInt = 256 << 20
    """Bytes those records hold at most (tokens, and with ``record_stability_info`` logprobs and versions:
    12 bytes a sampled token; each request's prompt once)."""
    recorded_ttl_s: PositiveFloat = 86_400.0
    """A record unused this long is dropped (Tinker: a recorded sequence can be trained on for one day after
    sampling, and each training request that uses it restarts that day)."""
    sample_use_retrieve_futures: bool = False
    """Tell SDKs to learn of finished samples from one ``retrieve_futures`` long poll per
    sampling session instead of one ``retrieve_future`` poll per sample."""
    sweep_interval_s: PositiveFloat = 5.0
    model_aliases: dict[str, str] = {}
    """Extra base-model names the server answers to, each -> the served model it stands for (the
    engine's model name or directory), e.g. ``{"Qwen/Qwen3-8B": "tiny"}`` for code that names a hub
    model; listed by ``get_server_capabilities``."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        for alias, target in self.model_aliases.items():
            if not alias.strip() or not target.strip():
                raise ConfigurationError(f"model_aliases[{alias!r}]={target!r}: alias and model must be "
                                         "non-empty names")
        check_auth(self.api_key, self.no_auth, self.key_file, self.host)

