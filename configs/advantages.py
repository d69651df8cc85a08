"""The group-advantage estimators (`esroll.grpo.advantages.ESTIMATORS`) and their ES counterparts, compared with the
fair-comparison protocol of `esroll.compare` (equal tuning budgets, settings chosen on validation, fresh evaluation
seeds, paired differences against plain GRPO).

    python -m experiments.compare --config configs/advantages.py[:variant] --workdir runs/advantages_<variant>

Every arm is plain GRPO (configs/compare.py's, lr 1e-4, 8 completions per prompt) with one thing changed: its
`grpo.advantage` (and that estimator's options, docs/advantages.md), or the reward (`data.reward = "majority"`,
label-free). The single-rollout arm (ntf) samples 1 completion for each of 8× as many prompts, so every GRPO arm
generates the same completions per step. The ES arms are LOO-ROLL with ES's counterparts of the estimators' ideas:
per-prompt normalisation of the members' rewards (`es.prompt_shaping = "grpo"`), max@2 fitness over 2 samples per
prompt (which needs sampling: it also moves the members' decoding from greedy to temperature 1, a second change),
the label-free majority vote over the population's answers.

Tuning: every arm gets the same budget (2 settings, one its own, on tuning seed 100, 20 s each), over the learning
rate (GRPO arms: log-uniform 3e-5 to 3e-4; ES arms: 1e-4 to 2e-3 and σ 0.002 to 0.01), chosen by validation AUC; then
5 evaluation seeds × 30 s on the test split. 30 s, because on the hard task plain GRPO reaches the 50-question test
split's ceiling in 19-26 s (configs/compare.py:tuned_hard, measured): a longer budget would score every estimator at
100% and leave only the AUC to tell them apart. The default task has no such ceiling (GRPO 88% at 120 s); it gets the
same 30 s so that both gold variants fit the ~2-hour budget, and its results describe early training. Sizes on
2 CPU cores, measured: `hard` 39 min (11 arms × 190 s of training, plus compilation and evaluation),
`label_free` 15 min (4 arms); `default` has the same arms as `hard`.

Variants:
  default      The default task (2-digit sums, the shipped model; GRPO meets ~15-35% all-equal groups early).
  hard         2-digit sums with two carries (`data.min_difficulty = 2`), train and held-out filtered from the default
               splits, so no held-out question was in the shipped model's pretraining: plain GRPO starts at 20% on
               the test split, meets 33% all-equal groups over its first 5 steps (28-36% by seed) and ends at 95% after
               30 s (measured, 5 seeds). 75 held-out questions: validation 25, test 50.
  label_free   The hard task without labels: rewards are the majority vote of each prompt's completions (GRPO,
               GMAE, DDRL) or of the population's answers (LOO-ROLL); gold answers score evaluation only.
  quick        Seconds per run, for the test suite: GRPO, single-rollout ntf and label-free DDRL (one compiled update
               for all three); two seeds, no tuning (configs/compare.py:tuned_quick tests that).
"""

from ml_collections import ConfigDict

from configs import compare

GOLD_ARMS = ("grpo", "rloo", "agrae", "bv_blend", "gmae", "maxpo", "lampo", "ntf")
ES_ARMS = ("looroll", "looroll_prompt_norm", "looroll_max2")
LABEL_FREE_ARMS = ("grpo_majority", "gmae_majority", "ddrl", "looroll_majority")
VARIANTS = {
    "default": "every gold-reward estimator and the ES counterparts on the default task (~45 min on 2 CPU cores)",
    "hard": "the same on 2-digit sums with two carries (39 min on 2 CPU cores, measured)",
    "label_free": "majority-vote rewards on the hard task: GRPO, GMAE, DDRL, LOO-ROLL (15 min on 2 CPU cores, measured)",
    "quick": "seconds per run, for the test suite",
}
GRPO_LR = {"optimizer": {"lr": "log:3e-5:3e-4"}}
ES_TUNE = {"optimizer": {"lr": "log:1e-4:2e-3"}, "es": {"sigma": "log:0.002:0.01"}}


def _arms(c: ConfigDict) -> dict[str, dict]:
    """Every arm's overrides of the comparison's base experiment (LOO-ROLL's): GRPO's, plus what the arm changes."""
    grpo, looroll = c.overrides["grpo"].to_dict(), c.overrides["looroll"].to_dict()

    def g(**grpo_changes):
        return {**grpo, "grpo": {**grpo.get("grpo", {}), **grpo_changes}}

    prompts = grpo.get("train", {}).get("prompts_per_step", c.experiment.train.prompts_per_step)
    group = grpo.get("grpo", {}).get("group_size", c.experiment.grpo.group_size)
    ntf = g(advantage="ntf", group_size=1)
    ntf["train"] = {**grpo.get("train", {}), "prompts_per_step": prompts * group}  # the same completions per step
    majority = {"data": {"reward": "majority"}}
    es_twice = {"es": {"samples": 2, "sample_reduce": "max"}, "train": {"temperature": 1.0}}
    return {
        "grpo": g(),
        "rloo": g(advantage="rloo"),
        # Sized from tuned_hard's GRPO rate (244-310 steps in 90 s) for a 30-s run; the hard comparison then took 67-79
        # steps in 30 s, so its schedules end 2/3 to 4/5 of the way (β ≈ 0.6-0.67 at the last step, not 0.5).
        "agrae": g(advantage="agrae", adv={"agrae": {"horizon": 100}}),
        "bv_blend": g(advantage="bv_blend"),
        "gmae": g(advantage="gmae"),
        "maxpo": g(advantage="maxpo", adv={"maxpo": {"k": 2}}),
        "lampo": g(advantage="lampo"),
        "ntf": ntf,
        "looroll": looroll,
        "looroll_prompt_norm": {**looroll, "es": {**looroll.get("es", {}), "prompt_shaping": "grpo"}},
        "looroll_max2": {**looroll, **es_twice, "es": {**looroll.get("es", {}), **es_twice["es"]}},
        "grpo_majority": {**g(), **majority},
        "gmae_majority": {**g(advantage="gmae"), **majority},
        "ddrl": {**g(advantage="ddrl"), **majority},
        "looroll_majority": {**looroll, **majority},
    }


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "default"
    if arg not in VARIANTS:
        raise ValueError(f"configs/advantages.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    c = compare.get_config("quick" if arg == "quick" else "default")
    c.overrides = _arms(c)
    c.seeds = (0, 1, 2, 3, 4)
    c.time_budget_s = 30.0
    c.experiment.data.validation_size = 128
    if arg in ("hard", "label_free"):
        c.experiment.data.min_difficulty = 2
        c.experiment.data.validation_size = 25
    names = {"label_free": LABEL_FREE_ARMS, "quick": ("grpo", "ntf", "ddrl")}.get(arg, GOLD_ARMS + ES_ARMS)
    c.methods = ",".join(names)
    c.reference = names[0]  # plain GRPO (label_free: GRPO on the majority-vote reward)
    c.tuning.seeds = (100,)
    c.tuning.runs = 2
    c.tuning.time_budget_s = 20.0
    c.tuning.space = {m: ES_TUNE if m.startswith("looroll") else GRPO_LR for m in names}
    c.tuning.shared_draws = True  # every GRPO arm tries the same learning rates, every ES arm the same settings
    if arg == "quick":
        c.experiment.data.eval_size = 32
        c.experiment.data.validation_size = 16
        c.seeds = (0, 1)
        c.time_budget_s = 1.0
        c.max_steps = 2
        c.tuning.seeds = ()  # the tuning protocol itself is exercised by configs/compare.py:tuned_quick
    return c
