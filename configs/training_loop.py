"""The training-loop methods (docs/training_loop.md) against plain GRPO and LOO-ROLL on the hard task, with the
fair-comparison protocol of `esroll.compare` (equal tuning budgets, settings chosen on validation, fresh seeds).

    python -m experiments.compare --config configs/training_loop.py[:variant] --workdir runs/training_loop

The task is configs/advantages.py's `hard` variant: 2-digit sums with two carries, train and held-out filtered from
the default splits (75 held-out questions: validation 25, test 50). Every arm is plain GRPO (configs/compare.py's)
or LOO-ROLL (the default experiment's) with one method switched on:

    grpo, looroll                   the references (paired differences are against grpo; looroll is an arm)
    grpo_adaprefix, looroll_adaprefix
                                    AdaPrefix: the direct answer's first tokens as a forced start, per-example
                                    controller at 50% success, withdrawn by the horizon (GRPO 40 steps, ES 30 steps:
                                    half of the steps of configs/advantages.py:hard's 30-s runs, 66-79 GRPO and 56-62
                                    LOO-ROLL; in the measured comparison the arms took 157-174 and 113-128 steps, so
                                    assistance ended about a fifth of the way in)
    grpo_ads, looroll_ads           adaptive data scheduling; every example of the hard task has two carries, so
                                    its difficulty clusters are one and ADS acts by boundary selection only
    grpo_stare                      STARE: top 20% surprisal tokens, α 0.5; its gate opens once the policy's entropy
                                    falls to 0.8 (it starts near 0.95 in a quick GRPO run) and closes at 1.0
    grpo_mu2, grpo_acpo             two passes per step (μ = 2), without and with ACPO's per-group clip ranges
    grpo_progress                   the progress advantage, η = 0.1

Budgets are configs/advantages.py:hard's: 2 settings per arm (its own and one shared draw: every GRPO arm tries the
same learning rates, every ES arm the same settings) on tuning seed 100, 20 s each, chosen by validation AUC; then 5
evaluation seeds × 30 s on the test split. 30 s, because plain GRPO reaches the 50-question test split's ceiling in
19-26 s (configs/compare.py:tuned_hard, measured): longer runs would score most arms at 100% and leave only the AUC.
Measured on 2 CPU cores: 43 min for the 10 arms (docs/results/training_loop.md).

Variants:
  default   the comparison above
  quick     seconds per run (3 arms), to check that it builds and runs
"""

from ml_collections import ConfigDict

from configs import advantages

ARMS = (
    "grpo",
    "looroll",
    "grpo_adaprefix",
    "looroll_adaprefix",
    "grpo_ads",
    "looroll_ads",
    "grpo_stare",
    "grpo_mu2",
    "grpo_acpo",
    "grpo_progress",
)
VARIANTS = {
    "default": "the training-loop methods vs GRPO and LOO-ROLL on the hard task (43 min on 2 CPU cores, measured)",
    "quick": "seconds per run, 3 arms",
}


def _with(base: dict, **sections) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in sections.items():
        out[section] = {**out.get(section, {}), **values}
    return out


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "default"
    if arg not in VARIANTS:
        raise ValueError(f"configs/training_loop.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    c = advantages.get_config("quick" if arg == "quick" else "hard")
    grpo, looroll = c.overrides["grpo"].to_dict(), c.overrides["looroll"].to_dict()
    # The hard task's direct answers are 4 tokens (" ", "1", tens, units: every sum is 100-198): k starts at 3 tokens,
    # the tens digit given, so the first prefixes carry information.
    prefix = {"prefix": True, "prefix_source": "target", "prefix_init": 0.75}
    c.overrides = {
        "grpo": grpo,
        "looroll": looroll,
        "grpo_adaprefix": _with(grpo, curriculum={**prefix, "prefix_horizon": 40}),
        "looroll_adaprefix": _with(looroll, curriculum={**prefix, "prefix_horizon": 30}),
        "grpo_ads": _with(grpo, curriculum={"ads": True}),
        "looroll_ads": _with(looroll, curriculum={"ads": True}),
        "grpo_stare": _with(
            grpo,
            grpo={
                "variants": ("stare",),
                "variant_options": {"stare": {"quantile": 0.8, "entropy_low": 0.8, "entropy_high": 1.0}},
            },
        ),
        "grpo_mu2": _with(grpo, grpo={"inner_iterations": 2}),
        "grpo_acpo": _with(grpo, grpo={"inner_iterations": 2, "variants": ("acpo",)}),
        "grpo_progress": _with(grpo, grpo={"variants": ("progress",), "variant_options": {"progress": {"coef": 0.1}}}),
    }
    names = ("grpo", "grpo_adaprefix", "looroll_ads") if arg == "quick" else ARMS
    c.methods = ",".join(names)
    c.reference = "grpo"
    c.tuning.space = {m: advantages.ES_TUNE if m.startswith("looroll") else advantages.GRPO_LR for m in names}
    return c
