"""esroll.baselines through esroll.es.shaping: hand-computed values for every shaping, the invariances each claims,
masking, errors.

GRPO follows TRL: (r − mean) / (std + 1e-4) with the sample std (ddof = 1; a group of one valid entry has std 0);
`grpo_population_std` keeps the population std (ddof = 0).
"""

from __future__ import annotations

import chex
import numpy as np
import pytest

from esroll.es import shaping as advantages

NAMES = sorted(advantages.SHAPINGS)
SHIFT_INVARIANT = ("zscore", "grpo", "grpo_population_std", "dr_grpo", "rloo", "centered_ranks")
SCALE_INVARIANT = ("zscore", "centered_ranks", "grpo", "grpo_population_std")  # up to their eps
HOMOGENEOUS = ("raw", "dr_grpo", "rloo")  # f(a r) = a f(r)
CENTERED = SHIFT_INVARIANT  # the valid entries of each group sum to 0

# Two groups whose squared deviations both sum to 27/4: mean 11/4 and 3/4, population std √(27/16) = 3√3/4,
# sample std √(27/12) = 3/2.
R = np.array([[1.0, 2.0, 4.0, 4.0], [0.0, 0.0, 0.0, 3.0]])
DEV = np.array([[-7 / 4, -3 / 4, 5 / 4, 5 / 4], [-3 / 4, -3 / 4, -3 / 4, 9 / 4]])
POP_STD, SAMPLE_STD = 3 * np.sqrt(3) / 4, 3 / 2
S3 = np.sqrt(3)
EXPECTED = {
    "raw": R,
    "dr_grpo": DEV,
    "zscore": np.array([[-7 / (3 * S3), -1 / S3, 5 / (3 * S3), 5 / (3 * S3)], [-1 / S3, -1 / S3, -1 / S3, S3]]),
    "grpo": DEV / (SAMPLE_STD + 1e-4),
    "grpo_population_std": DEV / (POP_STD + 1e-4),
    # r_i minus the mean of the other three: 1 − 10/3, 2 − 9/3, 4 − 7/3, ...; 0 − 1, ..., 3 − 0
    "rloo": np.array([[-7 / 3, -1.0, 5 / 3, 5 / 3], [-1.0, -1.0, -1.0, 3.0]]),
    # 0-based ranks, ties sharing their mean: [0, 1, 2.5, 2.5] and [1, 1, 1, 3], over n − 1 = 3, minus 1/2
    "centered_ranks": np.array([[-1 / 2, -1 / 6, 1 / 3, 1 / 3], [-1 / 6, -1 / 6, -1 / 6, 1 / 2]]),
}


def shaped(name, r, valid=None):
    out = advantages.get(name)(r, valid)
    chex.assert_shape(out, np.shape(r))
    return np.asarray(out, np.float64)


def random_groups(seed=0, shape=(3, 7)):
    return np.random.default_rng(seed).normal(size=shape)


# ---------------------------------------------------------------- values


def test_every_shaping_has_hand_computed_values():
    assert set(advantages.SHAPINGS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_values_on_hand_computed_groups(name):
    np.testing.assert_allclose(shaped(name, R), EXPECTED[name], rtol=1e-6, atol=1e-6)


def test_grpo_divides_by_the_sample_std():
    """Binary rewards [0, 1]: deviations ±1/2, sample std √½ (the population std would be ½, giving ±1)."""
    half = np.array([-0.5, 0.5])
    np.testing.assert_allclose(shaped("grpo", [0.0, 1.0]), half / (np.sqrt(0.5) + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(shaped("grpo_population_std", [0.0, 1.0]), half / (0.5 + 1e-4), rtol=1e-6)


@pytest.mark.parametrize("name, ddof", [("zscore", 0), ("grpo_population_std", 0), ("grpo", 1)])
def test_standardised_output_has_unit_std(name, ddof):
    r = random_groups(1, (4, 9))
    out = shaped(name, r)
    np.testing.assert_allclose(out.mean(1), 0, atol=1e-5)
    np.testing.assert_allclose(out.std(1, ddof=ddof), 1, rtol=1e-3)  # 1e-3: the eps next to a std of about 1


def test_grpo_eps_bounds_a_near_constant_group():
    """A spread far below eps is not blown up to unit scale (zscore's eps of 1e-8 would)."""
    r = np.array([1.0, 1.0 + 1e-6])
    assert np.abs(shaped("grpo", r)).max() < 1e-2
    assert np.abs(shaped("zscore", r)).max() > 0.5


@pytest.mark.parametrize("name", NAMES)
def test_equal_rewards(name):
    """A group of equal rewards carries no signal: every centred shaping gives zeros (raw gives the rewards)."""
    r = np.full((2, 5), 3.0)
    np.testing.assert_allclose(shaped(name, r), r if name == "raw" else 0.0, atol=1e-6)


# ---------------------------------------------------------------- invariances


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_shift_invariance(name):
    r = random_groups(2)
    shift = np.array([[5.0], [-30.0], [100.0]])  # a different shift per group
    # float32 keeps ~7 digits: a shift of 100 moves the rewards by up to ~1e-5, which the std of ~1 passes on.
    np.testing.assert_allclose(shaped(name, r + shift), shaped(name, r), atol=1e-4)


@pytest.mark.parametrize("name", SCALE_INVARIANT)
def test_scale_invariance(name):
    r = random_groups(3)
    scale = np.array([[0.5], [7.0], [1000.0]])
    # (r − mean)/(s + eps) at scale a is (r − mean)/(s + eps/a): grpo's eps of 1e-4 against a std s ≳ 0.5 at
    # a ≥ 0.5 moves values by under 1e-3 relatively; zscore's 1e-8 by 1e-7.
    rtol = 1e-3 if name.startswith("grpo") else 1e-5
    np.testing.assert_allclose(shaped(name, r * scale), shaped(name, r), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("name", HOMOGENEOUS)
def test_scale_homogeneity(name):
    r = random_groups(4)
    scale = np.array([[0.1], [-7.0], [1000.0]])
    np.testing.assert_allclose(shaped(name, r * scale), shaped(name, r) * scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariance_within_a_group(name):
    r = random_groups(5)
    r[0, 2] = r[0, 5]  # a tie, which must move with its entries
    valid = np.ones(r.shape, bool)
    valid[1, 3] = False
    base = shaped(name, r, valid)
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(r.shape[1])
        np.testing.assert_allclose(shaped(name, r[:, perm], valid[:, perm]), base[:, perm], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_groups_are_independent(name):
    r = random_groups(6)
    other = r.copy()
    other[1:] = random_groups(7)[1:]
    np.testing.assert_allclose(shaped(name, other)[0], shaped(name, r)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", CENTERED)
def test_centred_shapings_sum_to_zero_over_valid_entries(name):
    r = random_groups(8)
    valid = np.random.default_rng(9).random(r.shape) < 0.7
    valid[:, :2] = True
    np.testing.assert_allclose(shaped(name, r, valid).sum(1), 0, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_one_dimensional_input_is_one_group(name):
    r = random_groups(10, (6,))
    valid = np.array([True, True, False, True, True, True])
    chex.assert_trees_all_close(
        {"plain": shaped(name, r), "masked": shaped(name, r, valid)},
        {"plain": shaped(name, r[None])[0], "masked": shaped(name, r[None], valid[None])[0]},
        rtol=1e-6,
        atol=1e-6,
    )


# ---------------------------------------------------------------- invalid entries


@pytest.mark.parametrize("name", NAMES)
def test_invalid_entries_are_zero_and_do_not_change_the_others(name):
    """Masked, NaN, +inf and −inf entries come out 0; the others are shaped as if those were absent."""
    r = np.array([[3.0, np.nan, -1.0, 0.5, 7.0, np.inf, 2.0], [1e30, 1.0, -np.inf, 4.0, 4.0, 0.0, 9.0]])
    valid = np.array([[1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], bool)
    out = shaped(name, r, valid)
    invalid = ~valid | ~np.isfinite(r)
    assert np.all(out[invalid] == 0) and np.all(np.isfinite(out))
    for g in range(2):
        kept = ~invalid[g]
        np.testing.assert_allclose(out[g, kept], shaped(name, r[g, kept]), rtol=1e-6, atol=1e-6)


def test_invalid_entries_example_values():
    """Hand values with a NaN and a masked 0.5 dropped: the group is [3, −1, 7], mean 3, sample std 4."""
    r = np.array([3.0, np.nan, -1.0, 0.5, 7.0])
    valid = np.array([True, True, True, False, True])
    np.testing.assert_allclose(shaped("dr_grpo", r, valid), [0, 0, -4, 0, 4], atol=1e-6)
    np.testing.assert_allclose(shaped("grpo", r, valid), np.array([0, 0, -4, 0, 4]) / (4 + 1e-4), atol=1e-6)
    np.testing.assert_allclose(shaped("rloo", r, valid), [0, 0, -6, 0, 6], atol=1e-6)
    np.testing.assert_allclose(shaped("centered_ranks", r, valid), [0, 0, -0.5, 0, 0.5], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_fully_invalid_group_is_all_zero(name):
    r = np.array([[np.nan, 1.0, 2.0], [1.0, 2.0, 4.0]])
    valid = np.array([[True, False, False], [True, True, True]])
    out = shaped(name, r, valid)
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_allclose(out[1], shaped(name, r[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", CENTERED)
def test_one_valid_entry_gets_zero_advantage(name):
    """A group (or a 1-D member set) with fewer than 2 valid entries has nothing to compare: every centred shaping
    gives it 0 (docs/theory.md), the ddof-1 std taken as 0 (not 0/0). rloo used to return r itself (2.5 here) and
    centered_ranks −1/2."""
    r = np.array([[2.5, 9.0, np.nan], [2.5, 1.0, 0.0]])
    valid = np.array([[True, False, True], [True, False, False]])
    np.testing.assert_array_equal(shaped(name, r, valid), 0)
    np.testing.assert_array_equal(shaped(name, np.array([5.0])), 0)
    np.testing.assert_array_equal(shaped(name, np.array([np.nan, 5.0, 1.0]), np.array([True, True, False])), 0)
    # the other groups are shaped as before
    two = np.array([[2.5, 9.0, np.nan], [2.5, 1.0, 0.0]])
    np.testing.assert_allclose(shaped(name, two, valid | [[0, 0, 0], [0, 1, 0]])[1, :2], shaped(name, two[1, :2]))


def test_zscore_and_evosax_standardize_differ_at_a_small_spread():
    """esroll's zscore divides by std + 1e-8, evosax's (jax.nn.standardize, epsilon=1e-8) by √(var + 1e-8): equal
    for a wide spread, apart near std 1e-4 (docs/theory.md's figures)."""
    import jax

    x = np.array([0.0, 1.0, 2.0, 3.0])
    for scale, esroll, evosax in ((1e-4, [1.3415, 0.4472], [1.0, 1 / 3]), (1.0, [1.3416, 0.4472], [1.3416, 0.4472])):
        ours = shaped("zscore", x * scale)
        theirs = np.asarray(jax.nn.standardize(x * scale, epsilon=1e-8), np.float64)
        np.testing.assert_allclose(ours, np.array([-1, -1, 1, 1]) * np.array(esroll)[[0, 1, 1, 0]], atol=1e-4)
        np.testing.assert_allclose(theirs, np.array([-1, -1, 1, 1]) * np.array(evosax)[[0, 1, 1, 0]], atol=1e-4)


# ---------------------------------------------------------------- lookup


def test_get_returns_the_registered_function():
    for name, fn in advantages.SHAPINGS.items():
        assert advantages.get(name) is fn


def test_unknown_name():
    with pytest.raises(ValueError, match=r"unknown fitness shaping 'bogus'; expected one of raw, zscore"):
        advantages.get("bogus")
