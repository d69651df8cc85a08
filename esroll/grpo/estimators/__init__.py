"""The group-advantage estimators of recent papers, one module each, registered through
`esroll.grpo.advantages.register_advantage` as a user's own would be, each with its options dataclass beside its code
(`grpo.adv.<name>.<key>`). What each computes, and what its source leaves open, is in docs/advantages.md (the
step-level ones and GuAE: docs/step_level.md):

    agrae     A-GRAE: scheduled asymmetry of positive advantages and a difficulty focus moving from easy to hard
    bv_blend  BV-Blend: groups standardised by a blend of their own statistics and their cluster's EMA history
    gmae      GMAE: a response's centred advantage averaged over the group contexts it could have been sampled into
    maxpo     MaxPO: unbiased max@K (pass@K) policy-gradient weights with the leave-two-out baseline
    lampo     LamPO: pairwise reward gaps weighted by a confidence from the pair's log-probability difference
    ntf       negative token filtering: a batch-level baseline and no penalty on a negative sample's likely tokens
    ddrl      DDRL (label-free only): fixed ±a advantages from answer consistency, classes balanced over the batch
    guae      GuAE: group advantages tempered toward a running anchor with a variance-adaptive weight
    exprl     ExpRL's DeltaNorm: step credit from a reference-holding judge's prefix scores, s_k − s_{k−1}
    appo      APPO: branches at the tokens a Branching Score picks; token credit from both groups, scaled by Ω
    mc_steps  Monte Carlo step values (VinePPO): per-token advantages V(after step) − V(before) from branched rollouts
    sas       SAS: GRPO's advantage withheld from unconfident steps of right and confident steps of wrong completions
    verigate  VeriGate: GRPO where outcomes differ, else group-normalised future-cumulated step-verifier scores
    ibpo      IBPO: each step against its counterfactual siblings (same state, other step), policy-weighted
    graft     GRAFT: step credit V(target) − V(source) on the group's graph of states; graft_gae: Graph GAE on it
    progpo    ProGPO: exact-prefix step comparison plus transition credit from depth-fused state potentials
    discounted  multi-turn episodes: discounted per-turn returns normalised over the group (docs/agents.md)
    svm       Success Visitation Matching: turn rewards plus a clipped discriminator logit of successful visits
    gigpo     GiGPO: the episode's group advantage plus the turn's return against turns from the same state
    memopilot MemoPilot: each round's reward against the same round of the game's other episodes (fixed rounds)
    a2agent   A2Agent: turn returns compared within groups sharing the last k actions and the episode's, weighted
    repro     RePro: the model's own ratings of its moves after the episode as turn credit; the ratings trained too
    gae       PPO: GAE over generated tokens from a learned critic's values (docs/critics.md)
    srppo     SR-PPO: one completion per prompt, token credit from a success head's pass@k (docs/critics.md)
    hygae     HyGAE: turn-level and token-level GAE mixed, from one critic (multi-turn episodes, docs/critics.md)
    dae       DAE: a learned advantage model over the environment's actions, Σ_a π·Â = 0 (docs/critics.md)
    opd gndpo opd_plus  on-policy distillation from a teacher's token log-probabilities (docs/distillation.md)
"""

from esroll.grpo.estimators import (  # noqa: F401 — registers them
    a2agent,
    agrae,
    appo,
    bv_blend,
    dae,
    ddrl,
    exprl,
    distill,
    gmae,
    graft,
    guae,
    ibpo,
    lampo,
    maxpo,
    mc_steps,
    memopilot,
    ntf,
    progpo,
    repro,
    sas,
    turns,
    verigate,
    gae,
    hygae,
    srppo,
    svm,
)
