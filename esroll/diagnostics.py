"""Diagnostics of an update estimate: split-half signal-to-noise, cosines, effective rank of an update.

Pure functions of arrays and pytrees (jit-able, no I/O), meant to be computed inside a training step and logged.

Split-half SNR. Let ĝ₁, ĝ₂ be two estimates of the same update, each computed from a disjoint half of one step's
evaluations, independent of each other and identically distributed, with mean μ and covariance Σ₂ each, and let
ĝ = (ĝ₁ + ĝ₂)/2, whose covariance is Σ₂/2. Then
    𝔼⟨ĝ₁, ĝ₂⟩ = ‖μ‖²                      (independence: 𝔼ĝ₁ᵀĝ₂ = μᵀμ)
    𝔼 ¼‖ĝ₁ − ĝ₂‖² = ¼·2 tr Σ₂ = tr Cov(ĝ)
so `signal` = ⟨ĝ₁, ĝ₂⟩ and `noise` = ¼‖ĝ₁ − ĝ₂‖² are unbiased for ‖μ‖² and tr Cov(ĝ) from a single step, and
`snr` = signal / noise estimates SNR(ĝ) = ‖μ‖² / tr Cov(ĝ). That ratio of two unbiased estimates is itself biased
(by the noise in its denominator) and heavy-tailed, so to combine steps, average signal and noise separately and
take the ratio of the averages (consistent as the steps grow), not the mean of the per-step snr. signal may be
negative when the noise dominates. An SNR of s means that the estimate's expected squared error is 1/s times the squared norm of
what it estimates, and that 𝔼 cos(ĝ, μ)² ≈ s/(1 + s) in high dimension.

The halves of ES (directions, `esroll.es.diagnostics`) and of GRPO (prompt groups, `esroll.grpo`) are built by the
methods; this module only reads them.

"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


Array = jax.Array
GROUPS = ("attention", "mlp", "norm", "embed", "other")

_ATTENTION = {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"}
_MLP = {"gate", "up", "down"}
_EMBED = {"embed", "lm_head"}


# ---------------------------------------------------------------- inner products over pytrees


def _leaves(tree) -> dict[str, Array]:
    """{path: leaf} of any pytree, paths "/"-joined ("layers/q", as `esroll.es.noise` names them)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(key_path, simple=True, separator="/"): leaf for key_path, leaf in leaves}


def _dtype(*arrays) -> jnp.dtype:
    """float32, or float64 when an input is float64 (with x64 enabled)."""
    return jnp.result_type(jnp.float32, *[a.dtype for a in arrays])


def _sums(a: Array, b: Array) -> dict[str, Array]:
    """The additive pieces of the split-half figures for one pair of leaves: ⟨a,b⟩, ‖a‖², ‖b‖², ‖a−b‖², ‖a+b‖²."""
    dtype = _dtype(a, b)
    a, b = jnp.ravel(a).astype(dtype), jnp.ravel(b).astype(dtype)
    return {
        "dot": jnp.vdot(a, b),
        "sq1": jnp.vdot(a, a),
        "sq2": jnp.vdot(b, b),
        "sq_diff": jnp.sum((a - b) ** 2),  # formed directly: sq1 + sq2 − 2·dot cancels catastrophically at cos ≈ 1
        "sq_sum": jnp.sum((a + b) ** 2),
    }


def _ratio(x: Array, y: Array) -> Array:
    """x / y, NaN where y is 0 (the figure is undefined there, e.g. the cosine of a zero estimate)."""
    return jnp.where(y == 0, jnp.nan, x / jnp.where(y == 0, 1, y))


def _figures(s: dict[str, Array]) -> dict[str, Array]:
    signal, noise_ = s["dot"], s["sq_diff"] / 4
    return {
        "cosine": _ratio(s["dot"], jnp.sqrt(s["sq1"] * s["sq2"])),
        "snr": _ratio(signal, noise_),
        "signal": signal,
        "noise": noise_,
        "norm1": jnp.sqrt(s["sq1"]),
        "norm2": jnp.sqrt(s["sq2"]),
        "norm": jnp.sqrt(s["sq_sum"]) / 2,
    }


def _paired(g1, g2) -> tuple[dict[str, Array], dict[str, Array]]:
    a, b = _leaves(g1), _leaves(g2)
    if a.keys() != b.keys():
        raise ValueError(f"the two trees have different leaves: {sorted(a.keys() ^ b.keys())}")
    for path in a:
        if a[path].shape != b[path].shape:
            raise ValueError(f"leaf {path!r}: shapes {a[path].shape} and {b[path].shape} differ")
    return a, b


def _add(x: dict[str, Array] | None, y: dict[str, Array]) -> dict[str, Array]:
    return y if x is None else {k: x[k] + y[k] for k in x}


def cosine(a, b) -> Array:
    """⟨a, b⟩ / (‖a‖‖b‖) over every leaf of two pytrees of the same structure (NaN if either is zero)."""
    fa, fb = _paired(a, b)
    total = None
    for path in fa:
        total = _add(total, _sums(fa[path], fb[path]))
    if total is None:
        raise ValueError("cosine of empty trees")
    return _ratio(total["dot"], jnp.sqrt(total["sq1"] * total["sq2"]))


def split_half(g1, g2) -> dict[str, Array]:
    """Split-half figures of two independent half-estimates ĝ₁, ĝ₂ (pytrees of one structure), of ĝ = (ĝ₁+ĝ₂)/2:

        cosine  ⟨ĝ₁, ĝ₂⟩ / (‖ĝ₁‖‖ĝ₂‖)
        signal  ⟨ĝ₁, ĝ₂⟩, unbiased for ‖μ‖²
        noise   ¼‖ĝ₁ − ĝ₂‖², unbiased for tr Cov(ĝ)
        snr     signal / noise, an estimate of ‖μ‖² / tr Cov(ĝ) (see the module docstring)
        norm1, norm2, norm   ‖ĝ₁‖, ‖ĝ₂‖, ‖ĝ‖

    Scalars in float32 (float64 for float64 inputs); a ratio with a zero denominator is NaN.
    """
    return split_half_by_group(g1, g2, lambda path: "all")["total"]


def split_half_by_group(g1, g2, group_of: Callable[[str], str] | None = None) -> dict[str, dict[str, Array]]:
    """`split_half`'s figures per group of leaves, and over all leaves under "total".

    `group_of(path)` names the group of the leaf at `path` (a "/"-joined path as `esroll.es.noise` writes it, e.g.
    "layers/q"); default `leaf_group`. signal and noise add up over groups; a group's snr and cosine are its own
    (the total's snr is Σ signal / Σ noise, not a mean of the groups' snrs).
    """
    group_of = group_of or leaf_group
    fa, fb = _paired(g1, g2)
    if not fa:
        raise ValueError("split_half of empty trees")
    groups: dict[str, dict[str, Array]] = {}
    total = None
    for path in fa:
        s = _sums(fa[path], fb[path])
        name = group_of(path)
        groups[name] = _add(groups.get(name), s)
        total = _add(total, s)
    out = {name: _figures(s) for name, s in groups.items()}
    out["total"] = _figures(total)
    return out


def leaf_group(path: str) -> str:
    """The group of an esroll parameter path (`esroll.models.transformer`'s names):
    "attention" (q, k, v, o and their biases), "mlp" (gate, up, down), "norm" (attn_norm, mlp_norm, the Qwen3
    q_norm / k_norm, final_norm), "embed" (embed, lm_head); "other" for a name that is none of these."""
    name = path.rsplit("/", 1)[-1]
    if name in _ATTENTION:
        return "attention"
    if name in _MLP:
        return "mlp"
    if name in _EMBED:
        return "embed"
    if name.endswith("norm"):
        return "norm"
    return "other"


# ---------------------------------------------------------------- effective rank


def ranks_of_singular_values(s: Array) -> dict[str, Array]:
    """Effective ranks of a matrix from its singular values s [..., k] (the last axis):

        entropy        exp(H(p)), p = s/Σs, H the Shannon entropy (Roy & Vetterli 2007, 0·log 0 = 0)
        participation  (Σs)² / Σs²   (of the singular values, not of their squares)

    Both lie in [1, rank] and equal the rank when the nonzero singular values are equal; both are invariant to
    scaling the matrix. A zero matrix has effective ranks 0.
    """
    s = jnp.abs(s.astype(_dtype(s)))
    total = s.sum(-1)
    p = s / jnp.where(total == 0, 1, total)[..., None]
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1)), 0), -1)
    sq = jnp.sum(s**2, -1)
    return {
        "entropy": jnp.where(total == 0, 0, jnp.exp(entropy)),
        "participation": jnp.where(total == 0, 0, total**2 / jnp.where(sq == 0, 1, sq)),
    }


def effective_rank(matrix: Array) -> dict[str, Array]:
    """`ranks_of_singular_values` of a matrix [..., m, n] (leading axes batch: one figure per layer of a stacked
    leaf), by a dense SVD."""
    return ranks_of_singular_values(jnp.linalg.svd(matrix.astype(_dtype(matrix)), compute_uv=False))


def lowrank_singular_values(a: Array, w_E: Array, b: Array) -> Array:
    """Singular values [..., k], descending, k = min(m, n, E·r), of U = Σ_k w_k A_k B_kᵀ for factors
    a [..., E, m, r], b [..., E, n, r] (`esroll.es.noise.factors`' layout, leading axes batch) and weights w [E].

    U = 𝒜ℬᵀ with 𝒜 = [w_1A_1 … w_EA_E] [m, E·r] and ℬ = [B_1 … B_E] [n, E·r]; with 𝒜 = Q_aR_a, ℬ = Q_bR_b (reduced
    QR), U = Q_a(R_aR_bᵀ)Q_bᵀ, whose singular values are those of the small core R_aR_bᵀ: O((m+n)(E·r)²) work instead
    of the dense O(mn·min(m,n)), and U is never formed. The library's update divides by √r
    (`estimators.weighted_sum`); these singular values do not: multiply by 1/√r for its.
    """
    dtype = _dtype(a, b, w_E)
    a, b, w_E = a.astype(dtype), b.astype(dtype), w_E.astype(dtype)
    *lead, E, m, r = a.shape
    n = b.shape[-2]
    wa = a * w_E[:, None, None]
    stack_a = jnp.swapaxes(wa, -3, -2).reshape(*lead, m, E * r)  # column (k, ρ) is w_k·A_k[:, ρ]
    stack_b = jnp.swapaxes(b, -3, -2).reshape(*lead, n, E * r)
    _, r_a = jnp.linalg.qr(stack_a)  # [..., min(m, Er), Er]
    _, r_b = jnp.linalg.qr(stack_b)
    core = jnp.einsum("...ik,...jk->...ij", r_a, r_b, precision=jax.lax.Precision.HIGHEST)
    return jnp.linalg.svd(core, compute_uv=False)


def lowrank_effective_rank(a: Array, w_E: Array, b: Array) -> dict[str, Array]:
    """The effective ranks (`ranks_of_singular_values`) of Σ_k w_k A_k B_kᵀ, from its factors without forming it
    (`lowrank_singular_values`; equal to `effective_rank` of the dense sum). Scale-invariant, so the √r of the
    library's update and σ do not matter."""
    return ranks_of_singular_values(lowrank_singular_values(a, w_E, b))


def as_metrics(by_group: dict[str, dict[str, Array]], prefix: str = "diag") -> dict[str, Array]:
    """`split_half_by_group`'s figures as flat metric names: the total's as `<prefix>_<figure>` (snr, cosine, signal,
    noise, norm), each group's snr, cosine, signal and noise as `<prefix>_<figure>_<group>` (sum a group's signal and
    noise over steps before dividing, as for the total)."""
    out = {f"{prefix}_{name}": by_group["total"][name] for name in ("snr", "cosine", "signal", "noise", "norm")}
    for group, figures in by_group.items():
        if group != "total":
            out.update({f"{prefix}_{name}_{group}": figures[name] for name in ("snr", "cosine", "signal", "noise")})
    return out
