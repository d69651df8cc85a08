"""The estimator diagnostics in the trainer: diagnostics never feed the update (a run with them on ends with the
parameters, and every other metric, of the run with them off, which logs none), the halves add up to the step's own
estimate where the algebra says they must (EGGROLL's and GRPO's), the policy gradient the ES diagnostics compare with
is the gradient of its definition on the completions it sampled, and the settings are checked. (The ledger's
cumulative FLOPs, the sum of its steps' and the same resumed: tests/test_resume.py.)"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll import grpo, parallel
from esroll.experiment import check_names
from esroll.config import ConfigError, InputError, from_config_dict
from esroll.metrics import read_metrics
from esroll.train import train_and_evaluate

from conftest import quick_config

TIMINGS = ("tokens_per_s", "s_rollout", "s_scoring", "s_update", "s_diagnostics", "eval_s", "wall_time")


def run_config(variant: str, method: str | None = None, **train):
    """The quick runs of this file: 2 steps, a checkpoint after each, no export."""
    cfg = quick_config(variant, steps=2, eval_every=2, checkpoint_every=1)
    if method:
        cfg = dataclasses.replace(cfg, method=method)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, export=False, **train)).validate()


def run(tmp_path, name: str, variant: str, method: str | None = None, **train):
    out = train_and_evaluate(run_config(variant, method, **train), tmp_path / name, progress=False)
    steps = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["step"] > 0 and "tokens_per_s" in r]
    return jax.device_get(out["params"]), steps


def same_except_diagnostics(off: list[dict], on: list[dict]) -> None:
    for a, b in zip(off, on, strict=True):
        assert not any(k.startswith("diag_") for k in a) and any(k.startswith("diag_") for k in b)
        kept = {k: v for k, v in b.items() if not k.startswith("diag_") and k not in TIMINGS}
        assert {k: v for k, v in a.items() if k not in TIMINGS} == kept


@pytest.fixture(scope="module")
def looroll_off(tmp_path_factory):
    """(folder, (params, step records)) of the quick LOO-ROLL run with diagnostics off: the reference of
    test_es_diagnostics_leave_the_run_unchanged[looroll]."""
    folder = tmp_path_factory.mktemp("looroll")
    return folder, run(folder, "off", "quick", "looroll")


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["eggroll", "looroll"])
def test_es_diagnostics_leave_the_run_unchanged(tmp_path, method, request):
    """LOO-ROLL and EGGROLL with every diagnostic on (the policy-gradient cosine too) against off: bit-identical
    parameters and metrics. EGGROLL's halves average to its estimate exactly, so the norm of their mean is the
    update's gradient norm; the effective rank of a sum of E rank-r terms is at most E·r."""
    if method == "looroll":
        off, off_steps = request.getfixturevalue("looroll_off")[1]
    else:
        off, off_steps = run(tmp_path, "off", "quick", method)
    on, on_steps = run(tmp_path, "on", "quick", method, diagnostics_every=1, diagnostics_pg=True)
    chex.assert_trees_all_equal(off, on)
    same_except_diagnostics(off_steps, on_steps)
    cfg = quick_config("quick")
    directions = cfg.es.population // 2 if method == "eggroll" else cfg.es.population
    for r in on_steps:
        assert np.isfinite(r["diag_noise"]) and r["diag_noise"] > 0 and -1 <= r["diag_pg_cosine"] <= 1
        assert {"diag_snr_attention", "diag_snr_mlp", "diag_erank_q", "diag_pg_cosine_mlp"} <= set(r)
        assert 1 <= r["diag_erank"] <= directions * cfg.es.rank
        if method == "eggroll":
            assert r["diag_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


@pytest.mark.e2e
def test_grpo_diagnostics_leave_the_run_unchanged(tmp_path):
    """GRPO: the same, and the two halves' mean is the step's on-policy gradient (one pass, one minibatch), so the
    norm of their mean is the update's gradient norm."""
    off, off_steps = run(tmp_path, "off", "grpo_quick")
    on, on_steps = run(tmp_path, "on", "grpo_quick", diagnostics_every=1)
    chex.assert_trees_all_equal(off, on)
    same_except_diagnostics(off_steps, on_steps)
    for r in on_steps:
        assert r["diag_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert {"diag_snr", "diag_cosine_attention", "diag_snr_embed"} <= set(r)


@pytest.mark.e2e
def test_policy_gradient_is_the_ascent_direction_of_its_completions(monkeypatch):
    """The policy gradient an ES run's diag_pg_cosine compares with (`grpo.make_policy_gradient`, as the trainer
    builds it for `diagnostics_pg`) is the ascent direction of the reward on the completions it sampled: equal, leaf
    by leaf, to the gradient of Σ_b A_b/(B·L_b)·Σ_t log π_θ(y_bt), written out here from its definition (group
    advantages A = (r − mean)/(std₁ + 1e-4), the default aggregation's weights 1/(B·L_b), log π from a plain forward
    and log-softmax), on the completions captured from its rollout. A sign flipped in the advantage, the loss or the
    negation that turns the loss's gradient into an ascent direction fails it; `test_diagnostics.py::
    test_pg_cosine_has_the_sign_and_value_of_the_true_gradient` checks the ES side and the cosine."""
    from esroll.data import get_batch, make_splits
    from esroll.models import forward
    from esroll.task import load_task

    cfg = quick_config("quick", diagnostics_every=1, diagnostics_pg=True).validate()
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(cfg, train, held_out, mesh)
    captured, sample = [], grpo.method.rollout

    def rollout(*args, **kwargs):  # the real rollout, its output kept
        captured.append(sample(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(grpo.method, "rollout", rollout)
    X, G = cfg.train.prompts_per_step, cfg.grpo.group_size
    pg = grpo.make_policy_gradient(cfg, task, mesh)(params, get_batch(train, X, cfg.data.seed, 0), 0)
    (out,) = captured

    r = np.asarray(out.reward_B, np.float64).reshape(X, G)
    advantage_B = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    assert np.abs(advantage_B).max() > 0.5, "every group all equal: nothing to test"
    N = out.tokens_BxN.shape[1]
    mask = np.arange(N)[None, :] < out.length_B[:, None]
    weight = mask / (np.maximum(out.length_B, 1)[:, None] * X * G) * advantage_B[:, None]
    P = out.prompt_BxP.shape[1]
    tokens = jnp.concatenate([out.prompt_BxP, out.tokens_BxN], 1)
    token_mask = jnp.concatenate([out.prompt_mask_BxP, mask], 1)

    def objective(p):
        logits = forward(task.cfg, p, tokens, mask_BxT=token_mask)[0][:, P - 1 : -1]
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), out.tokens_BxN[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, logp, 0.0) * weight)

    ascent = jax.device_get(jax.jit(jax.grad(objective))(jax.device_get(params)))
    pg = jax.device_get(pg)
    chex.assert_trees_all_equal_shapes(ascent, pg)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ascent))
    for a, b in zip(jax.tree.leaves(ascent), jax.tree.leaves(pg)):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4 * scale)


def test_diagnostic_settings_are_checked():
    cd = quick_config("grpo_quick")
    with pytest.raises(ConfigError, match="invalid value for 'train.diagnostics_pg'"):
        check_names(
            dataclasses.replace(cd, train=dataclasses.replace(cd.train, diagnostics_every=1, diagnostics_pg=True))
        )
    with pytest.raises(ConfigError, match="invalid value for 'train.diagnostics_every'"):
        dataclasses.replace(cd, train=dataclasses.replace(cd.train, diagnostics_every=-1)).validate()
    es = quick_config("quick")
    small = dataclasses.replace(
        es, es=dataclasses.replace(es.es, population=2), train=dataclasses.replace(es.train, diagnostics_every=1)
    )
    with pytest.raises(ConfigError, match="invalid value for 'es.population': 2 .*split-half"):
        check_names(small)
    from configs.default import get_config

    raw = get_config("quick").to_dict()
    raw["train"]["diagnostics_every"] = 1.5
    with pytest.raises(InputError, match="train.diagnostics_every"):
        from_config_dict(raw)
