"""The REST listings of training runs and checkpoints, through the SDK's ``RestClient`` and the cookbook.

A key's runs and checkpoints, as the SDK reads them: live runs from the
registry, runs whose model is gone from their checkpoints on disk (after the
session ended, and on a new server over the same checkpoint directory); the
cookbook's ``get_renderer_name_from_checkpoint`` (unchanged) reading a run's
metadata by a checkpoint path; deleting a checkpoint; and another key seeing
none of it. References: the ids, paths and metadata the calls were made
with, and the checkpoint directories' own sizes on disk.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from rlengine.tinker_api import TinkerServerConfig, start

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")
from tinker_cookbook.checkpoint_utils import get_renderer_name_from_checkpoint

types = tinker.types

pytestmark = [
    pytest.mark.slow,
    # The cookbook calls SDK methods the SDK itself deprecates; the SDK leaves sockets to the collector.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

WAIT = 120.0
KEY_A, KEY_B = "tml-runs-a", "tml-runs-b"
META = {"renderer_name": "role_colon", "purpose": "resume"}


@pytest.fixture(scope="module")
def server(engine, ckpt_dir):
    # no_auth: each key is its caller's identity.
    srv = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, no_auth=True))
    yield srv
    srv.close()


def _step(training_client) -> None:
    tokens = [5, 9, 14, 20, 33, 41]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})
    training_client.forward_backward([datum], "cross_entropy").result(WAIT)
    training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result(WAIT)


def _size(ckpt_dir: str, path: str) -> int:
    directory = os.path.join(ckpt_dir, *path[len("tinker://"):].split("/"))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def test_runs_and_checkpoints_through_the_rest_client_and_the_cookbook(server, engine, ckpt_dir):
    url = server.url
    client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
    rest = tinker.RestClient(base_url=url, api_key=KEY_A)
    other = tinker.ServiceClient(base_url=url, api_key=KEY_B)
    stranger = tinker.RestClient(base_url=url, api_key=KEY_B)
    try:
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=1, user_metadata=META).result(WAIT)
        _step(tc)
        first = tc.save_state("first").result(WAIT).path
        sampler = tc.save_weights_for_sampler("for-sampling").result(WAIT).path
        _step(tc)
        last = tc.save_state("last").result(WAIT).path
        idle = client.create_lora_training_client(base_model="tiny", rank=2, seed=2).result(WAIT)
        run_id = tc.model_id

        # The run with saves was called last before the idle one was created: the idle one lists first.
        listing = rest.list_training_runs().result(WAIT)
        assert [r.training_run_id for r in listing.training_runs] == [idle.model_id, run_id]
        assert (listing.cursor.total_count, listing.cursor.offset, listing.cursor.limit) == (2, 0, 20)
        run = listing.training_runs[1]
        assert (run.base_model, run.is_lora, run.lora_rank, run.corrupted) == ("tiny", True, 4, False)
        assert run.user_metadata == META and run.model_owner
        assert run.last_checkpoint.tinker_path == last and run.last_sampler_checkpoint.tinker_path == sampler
        empty = listing.training_runs[0]
        assert empty.last_checkpoint is None and empty.last_sampler_checkpoint is None and empty.lora_rank == 2
        assert [r.training_run_id for r in rest.list_training_runs(limit=1, offset=1).result(WAIT).training_runs
                ] == [run_id]
        assert rest.get_training_run(run_id).result(WAIT) == run
        assert rest.get_training_run_by_tinker_path(first).result(WAIT) == run

        checkpoints = rest.list_checkpoints(run_id).result(WAIT).checkpoints
        assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in checkpoints] == [
            ("weights/last", "training", last), ("sampler_weights/for-sampling", "sampler", sampler),
            ("weights/first", "training", first)]
        assert [c.size_bytes for c in checkpoints] == [_size(ckpt_dir, c.tinker_path) for c in checkpoints]
        assert all(c.size_bytes > 0 and not c.public and c.expires_at is None for c in checkpoints)
        assert checkpoints[0].time >= checkpoints[1].time >= checkpoints[2].time
        assert rest.list_checkpoints(idle.model_id).result(WAIT).checkpoints == []
        mine = rest.list_user_checkpoints().result(WAIT)
        assert [c.tinker_path for c in mine.checkpoints] == [last, sampler, first] and mine.cursor.total_count == 3

        # The cookbook reads the renderer back by a checkpoint path; for another key there is none.
        assert get_renderer_name_from_checkpoint(client, first) == "role_colon"
        assert get_renderer_name_from_checkpoint(other, first) is None

        # Another key sees none of it, and may touch none of it.
        assert stranger.list_training_runs().result(WAIT).training_runs == []
        assert stranger.list_user_checkpoints().result(WAIT).checkpoints == []
        for call in (lambda: stranger.get_training_run(run_id), lambda: stranger.list_checkpoints(run_id),
                     lambda: stranger.get_training_run(idle.model_id),
                     lambda: stranger.delete_checkpoint_from_tinker_path(first)):
            with pytest.raises(tinker.PermissionDeniedError):
                call().result(WAIT)

        # Deleting a checkpoint removes it from disk and from the listings; the run stays.
        rest.delete_checkpoint_from_tinker_path(first).result(WAIT)
        assert not os.path.exists(os.path.join(ckpt_dir, run_id, "weights", "first"))
        assert [c.tinker_path for c in rest.list_checkpoints(run_id).result(WAIT).checkpoints] == [last, sampler]
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint_from_tinker_path(first).result(WAIT)
        with pytest.raises(tinker.NotFoundError):
            client.create_training_client_from_state(first).result(WAIT)
        assert rest.get_training_run_by_tinker_path(first).result(WAIT).training_run_id == run_id

        with pytest.raises(tinker.BadRequestError, match="training_runs.limit"):
            rest.list_training_runs(limit=-1).result(WAIT)
        with pytest.raises(tinker.BadRequestError, match="not_supported"):
            rest.list_training_runs(project_id="p").result(WAIT)
        with pytest.raises(tinker.NotFoundError):
            rest.get_training_run("no-such-run").result(WAIT)
    finally:
        client.close("success").result(WAIT)
        other.close("success").result(WAIT)

    # The session ended: its models are gone; the run with checkpoints is described from disk, the other
    # is gone (it saved nothing).
    fresh = tinker.ServiceClient(base_url=url, api_key=KEY_A)
    try:
        assert get_renderer_name_from_checkpoint(fresh, last) == "role_colon"
        gone = rest.get_training_run(run_id).result(WAIT)
        assert (gone.user_metadata, gone.lora_rank, gone.base_model) == (META, 4, "tiny")
        assert gone.last_checkpoint.tinker_path == last
        assert gone.last_request_time == rest.list_checkpoints(run_id).result(WAIT).checkpoints[0].time
        assert [r.training_run_id for r in rest.list_training_runs().result(WAIT).training_runs] == [run_id]
        with pytest.raises(tinker.APIStatusError) as err:
            rest.get_training_run(idle.model_id).result(WAIT)
        assert err.value.status_code == 410
    finally:
        fresh.close("success").result(WAIT)

    # A new server over the same checkpoint directory lists the run as the old one did.
    again = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, no_auth=True))
    try:
        restarted = tinker.RestClient(base_url=again.url, api_key=KEY_A)
        assert restarted.get_training_run(run_id).result(WAIT) == gone
        assert [c.tinker_path for c in restarted.list_user_checkpoints().result(WAIT).checkpoints] == [last, sampler]
        with pytest.raises(tinker.NotFoundError):
            restarted.get_training_run(idle.model_id).result(WAIT)
    finally:
        again.close()


def test_bad_listing_queries_are_typed_errors_naming_the_field(server):
    import httpx

    def call(method: str, path: str) -> dict:
        r = httpx.request(method, f"{server.url}/api/v1/{path}", headers={"X-API-Key": KEY_A}, timeout=WAIT)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for path, field, value in (("training_runs?limit=ten", "limit", "ten"),
                               ("training_runs?offset=-2", "training_runs.offset", -2),
                               ("training_runs?access_scope=public", "access_scope", "public"),
                               ("training_runs/run-1?access_scope=mine", "access_scope", "mine"),
                               ("checkpoints?limit=-1", "checkpoints.limit", -1)):
        body = call("GET", path)
        assert (body["code"], body["field"], body["value"]) == ("invalid", field, value)
    body = call("DELETE", "training_runs/run-1/checkpoints/adapters/x")
    assert body["field"] == "checkpoint_id" and "sampler_weights" in body["message"]
    body = call("DELETE", "training_runs/run-1/checkpoints/weights/..x")
    assert body["field"] == "checkpoint_id"
