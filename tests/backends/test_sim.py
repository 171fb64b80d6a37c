"""The sim backend and sim trainer, against hand-written references.

The sim trainer's gradients are checked against central finite differences of
its own loss (every loss function, in and out of the clipping regions), its
AdamW step against a per-element reference, and ``save_state``/``load_state``
for a bit-identical next step. The sim backend is driven directly through the
backend protocol.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from sim_gradients import central_difference

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.sim import SimBackend, decode_sim_token
from rlengine.seeding import mix
from rlengine.trainer.losses import clip_thresholds, elementwise
from rlengine.trainer.sim import SimTrainer

V = 16


def make_datum(loss_fn: str, rng: np.random.Generator, n: int = 6) -> rle.Datum:
    targets = rng.integers(0, V, n)
    inputs = {"target_tokens": targets}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.uniform(0, 1, n)
    else:
        # Sampler logprobs spread so that ratios land below, inside and above the clip range.
        inputs["logprobs"] = -np.log(V) + rng.uniform(-1.5, 1.5, n)
        inputs["advantages"] = rng.normal(0, 1, n)
    return rle.Datum(model_input=rle.ModelInput.from_ints(rng.integers(0, V, n)), loss_fn_inputs=inputs)


def total_loss(trainer: SimTrainer, data, loss_fn, thresholds) -> float:
    return trainer.forward(data, loss_fn, thresholds).metrics["loss:sum"]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_gradient_matches_finite_differences(loss_fn):
    rng = np.random.default_rng(0)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=1))
    data = [make_datum(loss_fn, rng) for _ in range(3)]
    thresholds = clip_thresholds(loss_fn, None)
    trainer.forward_backward(data, loss_fn, thresholds)
    grad = trainer.grad.copy()
    numeric = central_difference(trainer.theta, lambda: total_loss(trainer, data, loss_fn, thresholds))
    if loss_fn == "cispo":
        # CISPO stops the gradient through the clipped ratio: compare with the
        # derivative of sum(-c * A * logp) holding c fixed at its current value.
        logp_all = trainer._log_softmax()
        numeric = np.zeros(V)
        for d in data:
            inp = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
            t = inp["target_tokens"]
            c = np.clip(np.exp(logp_all[t] - inp["logprobs"]), *thresholds)
            w = -c * inp["advantages"]
            numeric += np.bincount(t, weights=w, minlength=V) - w.sum() * np.exp(logp_all)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-6)


def test_ppo_clipping_regions_by_hand():
    lo, hi = 0.8, 1.2
    logp = np.log(np.array([0.5, 1.0, 2.0, 0.5, 2.0]))  # ratios vs old logprob 0
    adv = np.array([1.0, 1.0, 1.0, -1.0, -1.0])
    inputs = {"advantages": adv, "logprobs": np.zeros(5)}
    loss, dlogp = elementwise("ppo", logp, inputs, (lo, hi))
    ratio = np.exp(logp)
    # By hand: A>0 clips above hi, A<0 clips below lo; min() keeps the pessimistic branch.
    expected = -np.array([0.5 * 1, 1.0 * 1, 1.2 * 1, 0.8 * -1, 2.0 * -1])
    np.testing.assert_allclose(loss, expected)
    np.testing.assert_allclose(dlogp, [-0.5, -1.0, 0.0, 0.0, ratio[4]])


def test_cispo_and_is_by_hand():
    logp = np.log(np.array([0.5, 5.0]))
    inputs = {"advantages": np.array([2.0, 2.0]), "logprobs": np.zeros(2)}
    loss, dlogp = elementwise("cispo", logp, inputs, (0.0, 4.0))
    np.testing.assert_allclose(loss, [-0.5 * 2 * logp[0], -4.0 * 2 * logp[1]])
    np.testing.assert_allclose(dlogp, [-1.0, -8.0])
    loss, dlogp = elementwise("importance_sampling", logp, inputs, (0.0, math.inf))
    np.testing.assert_allclose(loss, [-1.0, -10.0])


def test_adamw_step_matches_reference_and_clips():
    rng = np.random.default_rng(3)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    data = [make_datum("cross_entropy", rng)]
    params = rle.AdamParams(learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1,
                            grad_clip_norm=0.05)
    theta = trainer.theta.copy()
    m = np.zeros(V)
    v = np.zeros(V)
    for step in range(1, 4):
        trainer.forward_backward(data, "cross_entropy", (0.0, math.inf))
        g = trainer.grad.copy()
        norm = math.sqrt(sum(x * x for x in g))
        if norm > params.grad_clip_norm:
            g = g * (params.grad_clip_norm / (norm + 1e-6))
        out = trainer.optim_step(params)
        assert out.metrics["grad_norm"] == pytest.approx(norm)
        for i in range(V):
            theta[i] *= 1 - params.learning_rate * params.weight_decay
            m[i] = params.beta1 * m[i] + (1 - params.beta1) * g[i]
            v[i] = params.beta2 * v[i] + (1 - params.beta2) * g[i] ** 2
            mh = m[i] / (1 - params.beta1 ** step)
            vh = v[i] / (1 - params.beta2 ** step)
            theta[i] -= params.learning_rate * mh / (math.sqrt(vh) + params.eps)
        np.testing.assert_allclose(trainer.theta, theta, rtol=1e-12, atol=1e-14)
        assert not trainer.grad.any()


def test_gradients_accumulate_until_optim_step():
    rng = np.random.default_rng(4)
    a = SimTrainer(rle.SimConfig(vocab_size=V))
    b = SimTrainer(rle.SimConfig(vocab_size=V))
    d1, d2 = make_datum("cross_entropy", rng), make_datum("cross_entropy", rng)
    a.forward_backward([d1], "cross_entropy", (0, math.inf))
    a.forward_backward([d2], "cross_entropy", (0, math.inf))
    b.forward_backward([d1, d2], "cross_entropy", (0, math.inf))
    np.testing.assert_allclose(a.grad, b.grad)


def test_save_load_state_gives_bit_identical_next_step(tmp_path):
    rng = np.random.default_rng(5)
    cfg = rle.SimConfig(vocab_size=V)
    data = [make_datum("importance_sampling", rng)]
    a = SimTrainer(cfg)
    for _ in range(2):
        a.forward_backward(data, "importance_sampling", (0, math.inf))
        a.optim_step(rle.AdamParams(learning_rate=0.1))
    a.forward_backward(data, "importance_sampling", (0, math.inf))  # pending gradient is state too
    a.save_state(str(tmp_path / "ckpt"))
    b = SimTrainer(cfg)
    b.load_state(str(tmp_path / "ckpt"))
    for t in (a, b):
        t.optim_step(rle.AdamParams(learning_rate=0.1))
    assert a.theta.tobytes() == b.theta.tobytes()
    c = SimTrainer(cfg)
    with pytest.raises(rle.InvalidRequest, match="sim_state"):
        c.load_state(str(tmp_path))


def request(rid: str, prompt: list[int], max_tokens: int, seed: int = 0, **params) -> BackendRequest:
    return BackendRequest(request_id=rid, prompt=np.array(prompt, dtype=np.int32).tobytes(),
                          params=rle.SamplingParams(max_tokens=max_tokens, **params), seed=seed,
                          max_tokens=max_tokens)


def run(backend: SimBackend) -> dict[str, list]:
    out: dict[str, list] = {}
    while backend.has_unfinished_requests():
        for o in backend.step():
            out.setdefault(o.request_id, []).append(o)
    return out


def test_sim_backend_protocol_stops_and_logprobs():
    b = SimBackend(rle.SimConfig(vocab_size=V, gen_len=1000))
    greedy = int(np.argmax(rle.SimConfig(vocab_size=V).initial_weights()))
    b.add_request(request("len", [1, 2], 5, seed=1))
    b.add_request(request("greedy", [1], 3, temperature=0.0))
    b.add_request(request("stopid", [1], 50, seed=1, stop=[greedy]))
    outs = run(b)
    toks = [o.token_ids[0] for o in outs["len"]]
    assert len(toks) == 5 and outs["len"][-1].stop_reason == "length"
    assert [o.token_ids[0] for o in outs["greedy"]] == [greedy] * 3
    lp = b._logp
    assert [o.logprobs[0] for o in outs["len"]] == [lp[t] for t in toks]
    # Seeded the same, "stopid" follows "len"'s tokens until the stop id appears.
    sid = [o.token_ids[0] for o in outs["stopid"]]
    assert outs["stopid"][-1].stop_reason == "stop"
    assert sid[-1] == greedy or len(sid) == 50


def test_sim_backend_stop_strings_and_prompt_logprobs():
    b = SimBackend(rle.SimConfig(vocab_size=V, gen_len=1000))
    b.add_request(request("free", [3, 4, 5], 40, seed=9))
    b.add_request(BackendRequest(request_id="plp", prompt=np.array([3, 4, 5], dtype=np.int32).tobytes(),
                                 params=rle.SamplingParams(max_tokens=2), seed=0, max_tokens=2,
                                 prompt_logprobs=True, stream=False))
    outs = run(b)
    text = "".join(decode_sim_token(o.token_ids[0]) for o in outs["free"])
    stop = text[10:12]
    b.add_request(request("stopstr", [3, 4, 5], 40, seed=9, stop=[stop]))
    cut = "".join(decode_sim_token(o.token_ids[0]) for o in run(b)["stopstr"])
    assert cut.endswith(stop) and stop not in cut[:-1] and text.startswith(cut)
    (final,) = outs["plp"]  # non-streaming: one output, all tokens
    assert final.finished and len(final.token_ids) == 2
    assert final.prompt_logprobs == [b._logp[4], b._logp[5]]


def test_sim_backend_polices_sleep_and_abort():
    b = SimBackend(rle.SimConfig(vocab_size=V, gen_len=1000))
    b.add_request(request("a", [1], 100))
    b.step()
    with pytest.raises(RuntimeError, match="unfinished"):
        b.sleep()
    b.abort_request(["a", "unknown"])
    assert not b.has_unfinished_requests()
    b.sleep()
    b.add_request(request("b", [1], 3))
    with pytest.raises(RuntimeError, match="asleep"):
        b.step()
    b.wake_up()
    assert len(run(b)["b"]) == 3
    with pytest.raises(ValueError, match="theta"):
        b.load_weights([("bias", np.zeros(V))], 1)
    with pytest.raises(ValueError, match="shape"):
        b.load_weights([("theta", np.zeros(V + 1))], 1)


def test_sim_lognormal_lengths_are_seeded_and_heavy_tailed():
    b = SimBackend(rle.SimConfig(vocab_size=V, gen_len=8, gen_len_dist="lognormal", gen_len_sigma=1.0))
    lengths = [b._gen_len(seed) for seed in range(2000)]
    assert lengths == [b._gen_len(seed) for seed in range(2000)]
    assert np.median(lengths) == pytest.approx(8, abs=1)
    assert max(lengths) > 10 * np.median(lengths)


def test_sampled_tokens_are_the_scalar_hash_of_seed_and_position():
    """The backend draws a batch's tokens vectorized; each must equal the
    scalar reference ``mix(seed, pos) % vocab`` (seeds of any sign and size,
    sequences of different lengths in one batch)."""
    vocab = 1000
    b = SimBackend(rle.SimConfig(vocab_size=vocab, gen_len=50))
    seeds = [0, 1, 7, 2**63 - 1, 2**64 + 5, 12345678901234567890, 3**40]
    lengths = [1, 2, 50, 13, 7, 50, 3]
    params = rle.SamplingParams(max_tokens=50)
    for i, (seed, n) in enumerate(zip(seeds, lengths)):
        b.add_request(BackendRequest(f"r{i}", b"\x01\x00\x00\x00", params, seed, n, stream=False))
    got = {}
    while b.has_unfinished_requests():
        for out in b.step():
            got[out.request_id] = list(out.token_ids)
    for i, (seed, n) in enumerate(zip(seeds, lengths)):
        assert got[f"r{i}"] == [mix(seed, pos) % vocab for pos in range(n)], (seed, n)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_quiet_sequences_match_stepped_ones_across_a_weight_install(temperature):
    """A non-streaming sequence with no stop conditions is written out only
    when it ends; it must hold exactly what a streaming twin (visited every
    step) reports: the same tokens, each with its logprob under the weights of
    the step that made it, also when new weights arrive mid-sequence (greedy:
    the argmax changes with them), and an aborted one reports nothing."""
    vocab, n = 64, 9
    b = SimBackend(rle.SimConfig(vocab_size=vocab, gen_len=n))
    params = rle.SamplingParams(max_tokens=n, temperature=temperature)
    prompt = b"\x01\x00\x00\x00"
    b.add_request(BackendRequest("quiet", prompt, params, 11, n, stream=False))
    b.add_request(BackendRequest("stepped", prompt, params, 11, n, stream=True))
    b.add_request(BackendRequest("aborted", prompt, params, 12, n, stream=False))
    got: dict[str, tuple[list[int], list[float]]] = {"quiet": ([], []), "stepped": ([], [])}
    finished = set()

    def step():
        for out in b.step():
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(out.logprobs)
            if out.finished:
                finished.add(out.request_id)

    for _ in range(4):
        step()
    assert got["quiet"] == ([], [])  # nothing reported before the end
    b.abort_request(["aborted"])
    theta = np.random.default_rng(0).normal(0, 3, vocab).astype(np.float32)
    b.load_weights([("theta", theta)], version=1)
    while b.has_unfinished_requests():
        step()
    assert finished == {"quiet", "stepped"}
    assert got["quiet"][0] == got["stepped"][0] and len(got["quiet"][0]) == n
    assert got["quiet"][1] == got["stepped"][1]
    old, new = got["quiet"][1][:4], got["quiet"][1][4:]
    # The install changed the logprobs of the later tokens (and, greedy, the tokens).
    first = SimBackend(rle.SimConfig(vocab_size=vocab, gen_len=n))
    first.add_request(BackendRequest("ref", prompt, params, 11, n, stream=False))
    ref = []
    while first.has_unfinished_requests():
        ref += [out for out in first.step()]
    assert list(ref[0].logprobs)[:4] == old and list(ref[0].logprobs)[4:] != new
