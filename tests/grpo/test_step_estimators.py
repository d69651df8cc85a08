"""The step-level advantage estimators (SAS, VeriGate, IBPO, GRAFT, ProGPO), the task's step states, and GuAE on small
hand-built groups: the expected token advantages are worked out by hand in each test (the quantiles, returns, means,
variances, sibling sets and graph values written out below), and each trains through
`configs/step_level.py:<name>,quick`."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

from configs.step_level import get_config
from esroll import parallel
from esroll.config import from_config_dict
from esroll.data import TASKS, Example, get_batch, make_splits, prefix_states, step_states
from esroll.errors import InputError
from esroll.experiment import check_names
from esroll.grpo import advantages as A
from esroll.grpo import make_grpo_method
from esroll.grpo.estimators.graft import GraftGaeOptions
from esroll.grpo.estimators.guae import GuaeOptions
from esroll.grpo.estimators.ibpo import IbpoOptions
from esroll.grpo.estimators.progpo import ProgpoOptions
from esroll.grpo.estimators.sas import SasOptions
from esroll.grpo.estimators.verigate import VerigateOptions
from esroll.steps import Steps
from esroll.task import load_task

from conftest import REPO


def _group(rewards, step_BxN, token_logp=None, step_scores=None):
    """One step's groups from rows' step indices ([X·M, N], -1 past a completion)."""
    rewards = np.asarray(rewards, np.float64)
    X, M = rewards.shape
    step_BxN = np.asarray(step_BxN)
    N = step_BxN.shape[1]
    count_B = np.where(step_BxN >= 0, step_BxN + 1, 0).max(1)
    logp = np.zeros((X, M, N)) if token_logp is None else np.asarray(token_logp, np.float64).reshape(X, M, N)
    return A.Group(
        rewards,
        token_logp=logp,
        token_mask=(step_BxN >= 0).reshape(X, M, N),
        steps=Steps(step_BxN, count_B, (), ()),
        step_scores=None if step_scores is None else np.asarray(step_scores, np.float64),
    )


# ---------------------------------------------------------------- SAS


def test_sas_withholds_the_steps_beyond_the_batch_quantiles():
    """Rewards 1, 1, 0, 0: GRPO's advantage ±a with a = 0.5 / (√(1/3) + 1e-4) (mean 1/2, sample std √(1/3)).
    Step confidences (mean log-probability of the step's tokens): correct completions [-0.1, -2, -0.5] and [-1,
    -0.3]; failed ones [-0.2, -3, -0.05] and [-0.7]. The correct pool sorted is -2, -1, -0.5, -0.3, -0.1: its 0.25
    quantile is the second, -1, and only the step at -2 lies below. The failed pool -3, -0.7, -0.2, -0.05: its 0.75
    quantile at position 2.25 is -0.2 + 0.25 · 0.15 = -0.1625, and only -0.05 lies above."""
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    step = [
        [0, 0, 1, 1, 2],
        [0, 0, 1, -1, -1],
        [0, 1, 1, 2, -1],
        [0, 0, 0, 0, 0],
    ]
    logp = [
        [-0.1, -0.1, -2.5, -1.5, -0.5],
        [-1.0, -1.0, -0.3, 0, 0],
        [-0.2, -3.0, -3.0, -0.05, 0],
        [-0.7] * 5,
    ]
    g = _group([[1, 1, 0, 0]], step, logp)
    out = A.estimate("sas", g, SasOptions(q_low=0.25, q_high=0.75))
    expected = np.array(
        [
            [a, a, 0, 0, a],
            [a, a, a, 0, 0],
            [-a, -a, -a, 0, 0],
            [-a] * 5,
        ]
    )
    np.testing.assert_allclose(out.advantage.reshape(4, 5), expected, rtol=1e-6)
    assert out.advantage.dtype == np.float32
    assert out.metrics == {"sas_withheld_correct": 1 / 5, "sas_withheld_failed": 1 / 4}
    # quantiles 0 and 1 withhold nothing: GRPO's advantage on every completion token
    nothing = A.estimate("sas", g, SasOptions(q_low=0.0, q_high=1.0)).advantage.reshape(4, 5)
    np.testing.assert_allclose(nothing, np.where(np.array(step) >= 0, [[a], [a], [-a], [-a]], 0), rtol=1e-6)


def test_sas_leaves_out_invalid_completions_and_single_steps():
    """An invalid completion (NaN reward) gets 0 and its steps do not enter the pools: here the only other failed
    completion's single step (-1) is its own pool, whose 0.75 quantile is -1 itself, so nothing is withheld from it;
    the correct pool is the single steps -0.5 and -2 (one-step completions), whose 0.5 quantile is -1.25, below which
    the -2 step is withheld. GRPO over the valid 1, 1, 0: mean 2/3, sample std √(1/3)."""
    s = math.sqrt(1 / 3) + 1e-4
    g = _group(
        [[1, 1, 0, np.nan]],
        [[0, 0], [0, -1], [0, 0], [0, 1]],
        [[-0.5, -0.5], [-2.0, 0], [-1.0, -1.0], [-9.0, 9.0]],
    )
    out = A.estimate("sas", g, SasOptions(q_low=0.5, q_high=0.75)).advantage.reshape(4, 2)
    np.testing.assert_allclose(out, [[1 / 3 / s] * 2, [0, 0], [-2 / 3 / s] * 2, [0, 0]], rtol=1e-6)


# ---------------------------------------------------------------- VeriGate


def test_verigate_keeps_grpo_where_outcomes_differ_and_uses_step_returns_where_they_do_not():
    """Prompt 0 (rewards 1, 0) keeps GRPO: ±0.5 / (√(1/2) + 1e-4) on every token. Prompt 1 (rewards 0, 0) is gated:
    with γ = 0.5 the step scores [1, 0, 1] give returns G = [1 + 0.5·0.5, 0 + 0.5·1, 1] = [1.25, 0.5, 1] and [0, 1]
    give [0.5, 1]; pooled, mean 4.25 / 5 = 0.85 and sample variance (0.16 + 0.1225 + 0.0225 + 0.1225 + 0.0225) / 4
    = 0.1125, each step's tokens get (G − 0.85) / (√0.1125 + 1e-4)."""
    nan = np.nan
    step = [
        [0, 0, 1, -1, -1],
        [0, -1, -1, -1, -1],
        [0, 0, 1, 1, 2],
        [0, 1, -1, -1, -1],
    ]
    scores = np.full((2, 2, 3), nan)
    scores[0, 0, :2], scores[0, 1, :1] = (1, 1), (0,)
    scores[1, 0], scores[1, 1, :2] = (1, 0, 1), (0, 1)
    out = A.estimate("verigate", _group([[1, 0], [0, 0]], step, step_scores=scores), VerigateOptions(gamma=0.5))
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    z = lambda v: (v - 0.85) / (math.sqrt(0.1125) + 1e-4)  # noqa: E731
    expected = np.array(
        [
            [a, a, a, 0, 0],
            [-a, 0, 0, 0, 0],
            [z(1.25), z(1.25), z(0.5), z(0.5), z(1.0)],
            [z(0.5), z(1.0), 0, 0, 0],
        ]
    )
    np.testing.assert_allclose(out.advantage.reshape(4, 5), expected, rtol=1e-6)
    assert out.metrics == {"verigate_gated": 0.5, "verigate_gated_signal": 1.0}
    # γ = 1: the plain sums still to come, [2, 1, 1] and [1, 1]: mean 6/5, sample variance (0.64 + 4·0.04) / 4 = 0.2
    plain = A.estimate("verigate", _group([[1, 0], [0, 0]], step, step_scores=scores), VerigateOptions(gamma=1.0))
    z1 = lambda v: (v - 1.2) / (math.sqrt(0.2) + 1e-4)  # noqa: E731
    np.testing.assert_allclose(plain.advantage.reshape(4, 5)[2], [z1(2), z1(2), z1(1), z1(1), z1(1)], rtol=1e-6)


def test_verigate_gives_zero_to_a_gated_group_without_step_signal_and_to_invalid_completions():
    """Rewards 1, 1, each completion one step scoring 1: gated, equal returns, all 0. Rewards 0 and NaN: gated on the
    one valid completion, a single step: fewer than 2 steps to normalise, 0."""
    scores = np.ones((2, 2, 1))
    out = A.estimate("verigate", _group([[1, 1], [0, np.nan]], [[0, 0], [0, 0], [0, -1], [0, 0]], step_scores=scores))
    np.testing.assert_array_equal(out.advantage, 0)
    assert out.metrics == {"verigate_gated": 1.0, "verigate_gated_signal": 0.0}


# ---------------------------------------------------------------- GuAE


def test_guae_tempers_toward_its_anchor_and_carries_it_across_steps():
    """Step 1, rewards [[1, 1], [1, 0]], τ = 0.25: no past, so the anchor b is the batch mean 0.75. Group 0 has
    variance 0, weight 0: both get r − b = 0.25. Group 1 has variance 0.25, weight 0.25 / 0.5 = 1/2, GRPO advantage
    ±0.5 / (√(1/2) + 1e-4): 1/2 of it plus 1/2 of 1 − 0.75 and of 0 − 0.75 clipped to −0.5. The anchor after: 0.9·0.75 + 0.1·0.75.
    Step 2, all zero: weight 0, every entry r − b = −0.75, clipped to −0.5 by bound 0.5; anchor 0.9·0.75."""
    o = GuaeOptions(rate=0.1, tau=0.25, bound=0.5)
    state = A.init_estimator_state("guae", o)
    one = A.estimate("guae", A.Group(np.array([[1.0, 1.0], [1.0, 0.0]])), o, state)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    np.testing.assert_allclose(one.advantage, [[0.25, 0.25], [a / 2 + 0.125, -a / 2 - 0.25]], rtol=1e-6)
    assert one.metrics == {"guae_anchor": 0.75, "guae_weight": 0.25}
    assert float(one.state["anchor"]) == 0.75 and one.state["anchor"].dtype == np.float32
    two = A.estimate("guae", A.Group(np.zeros((2, 2))), o, one.state)
    np.testing.assert_array_equal(two.advantage, -0.5)
    assert float(two.state["anchor"]) == pytest.approx(0.675)


def test_guae_gives_invalid_entries_zero_and_a_batch_without_rewards_keeps_its_anchor():
    o = GuaeOptions(tau=0.25)
    state = {"anchor": np.asarray(0.5, np.float32), "seen": np.ones((), np.float32)}
    out = A.estimate("guae", A.Group(np.array([[1.0, np.nan], [np.nan, np.nan]])), o, state)
    np.testing.assert_allclose(out.advantage, [[0.5, 0], [0, 0]])  # a lone valid entry: weight 0, r − b = 0.5
    none = A.estimate("guae", A.Group(np.full((1, 2), np.nan)), o, state)
    assert float(none.state["anchor"]) == 0.5 and np.all(none.advantage == 0)


# ---------------------------------------------------------------- options, configs and training steps


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("sas.q_low", 1.5, "in [0, 1]"),
        ("verigate.gamma", -0.1, "in [0, 1]"),
        ("guae.rate", 0.0, "in (0, 1]"),
        ("guae.tau", 0.0, "a positive finite number"),
    ],
)
def test_bad_options_are_refused_naming_the_key(key, value, message):
    cd = get_config(key.split(".")[0] + ",quick")
    cd.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    name, field = key.split(".")
    cd.grpo.adv[name][field] = value
    expected = f"config: invalid value for 'grpo.adv.{key}': {value} (expected {message})"
    with pytest.raises(InputError, match=re.escape(expected)):
        check_names(from_config_dict(cd.to_dict()))


@pytest.fixture(scope="module")
def steps_task():
    cd = get_config("grpo,quick")
    cd.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    cfg = check_names(from_config_dict(cd.to_dict()))
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(cfg, train, held_out, mesh)
    return cfg, task, params, get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, 0), mesh


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["sas", "verigate", "guae", "ibpo", "graft", "graft_gae", "progpo"])
def test_a_training_step_by_name(steps_task, name):
    """`configs/step_level.py:<name>,quick` takes a GRPO step with the estimator: the same completions as plain GRPO
    (the rollout is keyed by seed and step), the estimator's metrics logged, finite parameters."""
    cfg, task, params, examples, mesh = steps_task
    cd = get_config(f"{name},quick")
    cd.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    c = check_names(from_config_dict(cd.to_dict()))
    assert c.grpo.advantage == name
    method = make_grpo_method(c, task, mesh)
    out = method.step(params, method.init(params, jax.random.key(0)), examples, 0)
    assert any(k.startswith(name) for k in out.metrics), sorted(out.metrics)
    assert all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(out.params))


# ---------------------------------------------------------------- states, IBPO and GRAFT


def test_arith_steps_states_meet_where_running_values_do():
    e = Example("arith_steps", "97-98-44=?", "-45", "97-98=-1\n-1-44=-45\n#### -45", " 97-98=-1")
    same = step_states(e, ["97-98=-1\n", "-1-44=-45\n", "#### -45"])
    other = step_states(e, ["97 - 98 = -1\n", "-1 - 44 = -45\n", "####  -45"])
    assert same == other == [("value", 1, -1), ("value", 2, -45), ("answer", -45)]
    wrong = step_states(e, ["97-98=-2\n", "so the answer\n", "=" * 5000 + "9" * 400])
    assert wrong[0] == ("value", 1, -2) and wrong[1] == "97-98=-2\nso the answer\n" and len(wrong) == 3
    # other tasks: the exact text so far
    g = Example("gsm_symbolic", "q", "1", "#### 1", " #### 1")
    assert step_states(g, ["a = 1\n", "#### 1"]) == ["a = 1\n", "a = 1\n#### 1"]


def test_a_tasks_faulty_step_state_is_an_error_naming_the_task(monkeypatch):
    e = Example("arith_steps", "1+2=?", "3", "1+2=3\n#### 3", " 1+2=3")
    spec = TASKS["arith_steps"]
    monkeypatch.setitem(TASKS, "arith_steps", spec._replace(step_state=lambda example, steps: ["one"]))
    with pytest.raises(ValueError, match="^task 'arith_steps': step_state gave 1 keys for 2 steps$"):
        step_states(e, ["1+2=3\n", "#### 3"])
    monkeypatch.setitem(TASKS, "arith_steps", spec._replace(step_state=lambda example, steps: 1 / 0))
    with pytest.raises(ValueError, match="^task 'arith_steps': step_state failed on 2 steps: ZeroDivisionError"):
        step_states(e, ["1+2=3\n", "#### 3"])


def test_state_ids_are_equal_within_a_prompt_exactly_where_keys_are():
    keys = [["a", "b"], ["a", "c", "b"], ["a"], ["b", "a"]]  # prompt 0: rows 0, 1; prompt 1: rows 2, 3
    ids = A.state_ids(keys, 2, 2, 3)
    np.testing.assert_array_equal(ids, [[[0, 1, -1], [0, 2, 1]], [[0, -1, -1], [1, 0, -1]]])


def _state_group():
    """One prompt, five completions over states A=0, B=1, C=2, D=3, E=4 (token steps and log-probabilities below):
    c0: A then C, reward 1; c1: A then D, 0; c2: B then C (C reached by another prefix), 1; c3: E in one step, 0;
    c4: A then C, reward NaN (invalid: in no value, no sibling set). A second prompt whose rewards are all 1."""
    step = [
        [0, 0, 1, 1],
        [0, 0, 1, -1],
        [0, 1, 1, -1],
        [0, 0, 0, 0],
        [0, 0, 1, 1],
        [0, 1, -1, -1],
        [0, -1, -1, -1],
        [0, 0, 0, -1],
        [0, 1, 1, 1],
        [0, 0, 1, -1],
    ]
    logp = [
        [-0.5, -0.5, -1.0, -1.0],  # steps -1, -2
        [-0.5, -0.5, -3.0, 0],  # -1, -3
        [-2.0, -0.5, -0.5, 0],  # -2, -1
        [-0.25] * 4,  # -1
        [0.0] * 4,
    ] + [[-0.1] * 4] * 5
    g = _group([[1, 0, 1, 0, np.nan], [1, 1, 1, 1, 1]], step, logp)
    states = np.array(
        [
            [[0, 2], [0, 3], [1, 2], [4, -1], [0, 2]],
            [[0, 1], [2, -1], [0, -1], [0, 1], [0, 1]],
        ]
    )
    return g._replace(states=states), np.array(step)


def _tokens(step, per_step):
    """Token advantages of rows from their steps' advantages (0 past a completion)."""
    return np.array([[per_step[b][s] if s >= 0 else 0.0 for s in row] for b, row in enumerate(step)])


def test_graft_values_and_edge_credit_on_a_state_graph():
    """Values: C is where c0 and c2 end (1, 1): V(C) = 1; V(D) = 0 (c1 ends there); V(E) = 0 (c3); V(A) = (1·V(C) +
    1·V(D)) / 2 = 1/2 (c4, invalid, adds no edge A→C); V(B) = V(C) = 1; V(prompt) = (2·V(A) + V(B) + V(E)) / 4 = 1/2.
    Credits V(target) − V(source): c0 0, 1/2; c1 0, −1/2; c2 1/2, 0; c3 −1/2; the all-1 prompt: every value 1, 0."""
    g, step = _state_group()
    out = A.estimate("graft", g)
    per_step = [[0, 0.5], [0, -0.5], [0.5, 0], [-0.5], [0, 0]] + [[0, 0, 0]] * 5
    np.testing.assert_allclose(out.advantage.reshape(10, 4), _tokens(step, per_step), atol=1e-12)
    assert out.metrics["graft_root_value"] == pytest.approx((0.5 + 1.0) / 2)


@pytest.mark.parametrize(
    "gamma, lam, per_step",
    [
        # λ = 1, γ = 1: the reward less V(before the step): c0 1 − 1/2, 1 − V(A); c1 −1/2, −1/2; c2 1/2, 1 − V(B) = 0
        (1.0, 1.0, [[0.5, 0.5], [-0.5, -0.5], [0.5, 0], [-0.5]]),
        # λ = 0, γ = 1: one-step differences, the last against the reward: GRAFT's credits here
        (1.0, 0.0, [[0, 0.5], [0, -0.5], [0.5, 0], [-0.5]]),
        # γ = λ = 1/2, c0: δ0 = 0.5·V(A) − V(prompt) = −1/4, δ1 = 1 − V(A) = 1/2, A0 = −1/4 + 1/4·1/2 = −1/8;
        # c1: δ0 = −1/4, δ1 = −1/2, A0 = −1/4 − 1/8; c2: δ0 = 0.5·1 − 1/2 = 0, δ1 = 0; c3: δ = 0 − 1/2
        (0.5, 0.5, [[-0.125, 0.5], [-0.375, -0.5], [0, 0], [-0.5]]),
    ],
)
def test_graph_gae_along_each_path(gamma, lam, per_step):
    g, step = _state_group()
    out = A.estimate("graft_gae", g, GraftGaeOptions(gamma=gamma, lam=lam))
    # c4 (invalid) gets 0; on the all-1 prompt every value is 1, so a two-step row has δ0 = γ − 1 and δ1 = 0 (0 at
    # γ = 1) and a one-step row δ = 0
    d = gamma - 1
    expected = _tokens(step, per_step + [[0, 0], [d, 0], [0], [0], [d, 0], [d, 0]])
    np.testing.assert_allclose(out.advantage.reshape(10, 4), expected, atol=1e-12)


def test_graft_values_on_a_state_graph_with_cycles():
    """arith_steps' states can form cycles: "#### 3" then "3+1=4" in one completion and the other order in another
    give P = ("answer", 3) and Q = ("value", 2, 4) an edge each way, and a repeated "#### 3" is a loop at P. With
    O = ("value", 1, 3): c0 O→P→Q, ends at Q, reward 0; c1 O→Q→P, ends at P, 1; c2 P→P, ends at P, 1. By hand:
    V(P) = (1 + 1 + V(Q) + V(P)) / 4 and V(Q) = (0 + V(P)) / 2 give V(P) = 4/5, V(Q) = 2/5; V(O) = (V(P) + V(Q)) / 2
    = 3/5; V(prompt) = (2·V(O) + V(P)) / 3 = 2/3. Credits V(target) − V(source): c0 −1/15, 1/5, −2/5; c1 −1/15, −1/5,
    2/5; c2 2/15, 0."""
    texts = [["1+2=3\n", "#### 3\n", "3+1=4\n"], ["1+2=3\n", "3+1=4\n", "#### 3\n"], ["#### 3\n", "#### 3\n"]]
    e = Example("arith_steps", "1+2+1=?", "4", "1+2=3\n3+1=4\n#### 4", " 1+2=3")
    keys = [step_states(e, t) for t in texts]
    O, P, Q = ("value", 1, 3), ("answer", 3), ("value", 2, 4)
    assert keys == [[O, P, Q], [O, Q, P], [P, P]]
    step = [[0, 1, 2], [0, 1, 2], [0, 1, -1]]
    g = _group([[0, 1, 1]], step)._replace(states=A.state_ids(keys, 1, 3, 3))
    # the same values from the linear equations V = W·V + b, W[n, m] = (steps n→m) / (steps out of n + ends at n),
    # b[n] = (rewards ending at n) / (the same), solved directly; nodes prompt, O, P, Q
    W = np.array([[0, 2 / 3, 1 / 3, 0], [0, 0, 1 / 2, 1 / 2], [0, 0, 1 / 4, 1 / 4], [0, 0, 1 / 2, 0]])
    b = np.array([0, 0, 2 / 4, 0 / 2])
    by_hand = np.array([2 / 3, 3 / 5, 4 / 5, 2 / 5])
    np.testing.assert_allclose(np.linalg.solve(np.eye(4) - W, b), by_hand, atol=1e-12)
    out = A.estimate("graft", g)
    per_step = [[-1 / 15, 1 / 5, -2 / 5], [-1 / 15, -1 / 5, 2 / 5], [2 / 15, 0]]
    np.testing.assert_allclose(out.advantage.reshape(3, 3), _tokens(step, per_step), atol=1e-10)
    assert out.metrics["graft_root_value"] == pytest.approx(2 / 3, abs=1e-10)
    assert out.metrics["graft_nodes"] == 4


def test_ibpo_compares_each_step_with_its_counterfactual_siblings():
    """From the prompt: c0 and c1 took A; their siblings are c2's B (reward 1, step probability e^−2) and c3's E (0,
    e^−1): baseline e^−2 / (e^−2 + e^−1) = 1 / (1 + e), so c0 gets 1 − 1/(1 + e) and c1 −1/(1 + e). c2 took B:
    siblings A (mean reward 1/2 over c0, c1, mean probability e^−1) and E (0, e^−1): baseline 1/4, advantage 3/4. c3
    took E: siblings A (1/2, e^−1) and B (1, e^−2): baseline (e^−1/2 + e^−2) / (e^−1 + e^−2). From A: c0's C against
    c1's D (0): 1; c1's D against C (1): −1. c2's step from B has no sibling: 0. The all-1 prompt: r − b = 0."""
    g, step = _state_group()
    e = math.e
    c3 = -(0.5 / e + 1 / e**2) / (1 / e + 1 / e**2)
    per_step = [[1 - 1 / (1 + e), 1], [-1 / (1 + e), -1], [0.75, 0], [c3], [0, 0]] + [[0, 0, 0]] * 5
    out = A.estimate("ibpo", g, IbpoOptions(group_weight=0.0))
    np.testing.assert_allclose(out.advantage.reshape(10, 4), _tokens(step, per_step), rtol=1e-6, atol=1e-7)
    assert out.metrics["ibpo_steps_with_siblings"] == pytest.approx(11 / 15)  # 6 of 7 steps, and 5 of 8
    # with half the group advantage added: GRPO over the valid 1, 0, 1, 0 is ±0.5 / (√(1/3) + 1e-4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    plus = [a, -a, a, -a, 0] + [0] * 5
    with_group = A.estimate("ibpo", g, IbpoOptions(group_weight=0.5)).advantage.reshape(10, 4)
    expected = _tokens(step, [[v + 0.5 * p for v in row] for row, p in zip(per_step, plus)])
    np.testing.assert_allclose(with_group, np.where(step >= 0, expected, 0), rtol=1e-6, atol=1e-7)
    # IBPO and GRAFT credit this group differently (c0's first step: 1 − 1/(1 + e) against 0)
    assert not np.allclose(out.advantage, A.estimate("graft", g).advantage)


def _text_group():
    """One prompt, steps by text: c0 "a", "b" (reward 1); c1 "a", "c" (0); c2 "d", "b" (0); c3 "d" (1, one step);
    c4 "a", "b" (NaN: invalid). States are exact prefixes (`prefix_states`)."""
    texts = [("a", "b"), ("a", "c"), ("d", "b"), ("d",), ("a", "b")]
    step = np.array([[0, 1, -1], [0, 1, -1], [0, 0, 1], [0, -1, -1], [0, 1, -1]])
    g = _group([[1, 0, 0, 1, np.nan]], step, np.full((5, 3), -0.5))
    g = g._replace(steps=g.steps._replace(text=tuple(texts)))
    keys = [prefix_states(None, t) for t in texts]
    return g._replace(states=A.state_ids(keys, 1, 5, 2)), step


@pytest.mark.parametrize(
    "depths, per_step",
    [
        # Exact-prefix comparison: from the prompt, "a" (rewards 1, 0) and "d" (0, 1) both average 1/2 as does the
        # group: 0; from "a", "b" (1) and "c" (0) against their mean 1/2: ±1/2; from "d" only c2 went on: 0.
        # H = 1: Φ is the mean reward through the last step's text: Φ(a) = Φ(d) = 1/2 (= Φ(prompt)), Φ(b) = 1/2
        # (c0's 1, c2's 0), Φ(c) = 0: transitions 0 everywhere but c1's second step, −1/2.
        (1, [[0, 0.5], [0, -1.0], [0, 0], [0]]),
        # H = 2: after the second step the depth-2 states ("a", "b"), ("a", "c"), ("d", "b") have one completion
        # each (p = 1, 0, 0; v = 0.75·0.25 / 1 = 3/16, weight 16/3); depth 1's "b" has p = 1/2 over 2 (p̃ = 1/2,
        # v = 1/8, weight 8). Fused Φ after c0's "b" = (8·1/2 + 16/3·1) / (8 + 16/3) = 0.7, after c2's "b" 0.3,
        # after c1's "c" 0 (both depths 0). Transitions: c0 0.2, c1 −1/2, c2 −0.2.
        (2, [[0, 0.7], [0, -1.0], [0, -0.2], [0]]),
    ],
)
def test_progpo_exact_prefix_comparison_and_fused_potentials(depths, per_step):
    g, step = _text_group()
    out = A.estimate("progpo", g, ProgpoOptions(depths=depths))
    expected = _tokens(step, per_step + [[0, 0]])
    np.testing.assert_allclose(out.advantage.reshape(5, 3), expected, atol=1e-6)
    assert out.metrics["progpo_steps_with_peers"] == pytest.approx(6 / 7)  # all but c2's second step


def test_ibpo_graft_and_progpo_credit_one_group_differently():
    """On the group above (exact-prefix states), c0's second step: IBPO 1 − 0 = 1 (its sibling "c" scored 0) plus
    half of GRPO's advantage; GRAFT V(a, b) − V(a) = 1 − 1/2; ProGPO 1/2 + 0 (H = 1)."""
    g, _ = _text_group()
    out = {name: A.estimate(name, g).advantage.reshape(5, 3) for name in ("ibpo", "graft", "progpo")}
    o = ProgpoOptions(depths=1)
    out["progpo"] = A.estimate("progpo", g, o).advantage.reshape(5, 3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # GRPO over the valid 1, 0, 0, 1
    assert out["ibpo"][0, 1] == pytest.approx(1 + 0.5 * a) and out["graft"][0, 1] == pytest.approx(0.5)
    assert out["progpo"][0, 1] == pytest.approx(0.5)
    for x, y in (("ibpo", "graft"), ("ibpo", "progpo"), ("graft", "progpo")):
        assert not np.allclose(out[x], out[y]), (x, y)
