"""Speed against Tunix (`google-tunix`: JAX/Flax NNX, its own Qwen3, a sampler and a GRPO learner), the closest JAX
peer, on the same weights, prompts and settings, both sides in this process.

    generate_vs_tunix   greedy tokens/s, esroll `generate` over Tunix's `Sampler` (median of interleaved rounds)
    grpo_step_vs_tunix  completion tokens/s of a full GRPO step (sampling + update), esroll over Tunix's
                        `GRPOLearner` on an `RLCluster` (vanilla rollout), the two alternating step by step

The model is a random Qwen3 of the "mid" shape (hidden 1024; "quick" under --quick; --model picks another) with
rope_theta 1e6 (Tunix 0.1.7's Qwen3 attention assumes it), saved once and loaded by both sides; prompts and rewards
come from `_idtask` (token ids as words, no EOS, so every completion has exactly `new_tokens` tokens on both sides).
Each result lists the settings that could not be matched under "unmatched". Tunix is optional (the `bench` extra);
without it the figures are None, with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from esroll import parallel
from esroll.config import make_optimizer
from esroll.sampling import generate
from experiments.benchmarks import _idtask
from experiments.benchmarks._shapes import shape_name
from experiments.benchmarks.generation import _TIMING, _median_times


def _missing() -> str | None:
    try:
        import tunix  # noqa: F401
    except ImportError as e:
        return f"Tunix is not installed ({e}); pip install -e '.[bench]'"
    return None


class _IdTokenizer:
    """What Tunix's sampler and learner call on a tokenizer, for `_idtask` text: a prompt "5 17 33" is ids 5, 17, 33."""

    def __init__(self, eos: int, pad: int):
        self._eos, self._pad = eos, pad

    def encode(self, text, **_):
        return [int(w) for w in text.split()]

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None  # no BOS prepended

    def eos_id(self):
        return self._eos

    def pad_id(self):
        return self._pad


def _tunix_model(folder: str, mesh=None):
    """Tunix's Qwen3 with the saved model's sizes (Tunix 0.1.7 has presets only) and its weights, float32."""
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    c = json.loads((Path(folder) / "config.json").read_text())
    cfg = qwen3_model.ModelConfig(
        num_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"],
        head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"],
        rope_theta=int(_idtask.rope_theta(folder)),
        norm_eps=c["rms_norm_eps"],
        use_tied_embedding=c["tie_word_embeddings"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    return cfg, qwen3_params.create_model_from_safe_tensors(folder, cfg, mesh=mesh, dtype=jnp.float32)


def generate_vs_tunix(args) -> dict:
    """Greedy generation, batch 64, 64 new tokens, 32-token prompts (quick: 8, 16, 16), esroll's rows split over every
    device (one per core, as the trainers run) and on one device, against Tunix's `Sampler`."""
    if not args.no_peers and (reason := _missing()):
        return {"generate_vs_tunix": None, "reason": reason}
    batch, n, prompt_len, reps = (8, 16, 16, 2) if args.quick else (64, 64, 32, 7)
    name = shape_name(args)
    with tempfile.TemporaryDirectory() as folder:
        cfg, params = _idtask.save_model(folder, name)
        if not args.no_peers:
            tcfg, model = _tunix_model(folder)
    texts = _idtask.prompts(cfg.vocab_size, batch, prompt_len)
    tokens = np.array([[int(w) for w in t.split()] for t in texts], np.int32)
    mask = np.ones_like(tokens, bool)
    meshes = _idtask.esroll_meshes(params)
    placed = {
        side: (parallel.put_replicated(m, params), parallel.put_rows(m, tokens), parallel.put_rows(m, mask))
        for side, m in meshes.items()
    }

    def ours(params, tokens, mask):
        return generate(
            cfg, params, tokens, jax.random.key(0), max_new_tokens=n, temperature=0.0, prompt_mask=mask
        ).tokens.block_until_ready()

    runs = {side: functools.partial(ours, *args) for side, args in placed.items()}
    generated = batch * n
    esroll_figures = {
        "shape": name,
        **{f"esroll_devices{side.removeprefix('ours')}": m.size for side, m in meshes.items()},
        "batch": batch,
        "new_tokens": n,
        "prompt_len": prompt_len,
        "reps": reps,
        "timing": _TIMING,
    }

    def esroll_rates(t: dict) -> dict:
        return {f"esroll_tokens_per_s{side.removeprefix('ours')}": generated / t[side] for side in meshes}

    if args.no_peers:
        return _idtask.ours_only("generate_vs_tunix", esroll_rates(_median_times(runs, reps)) | esroll_figures)
    import tunix
    from tunix.generate import sampler as sampler_lib

    cache = sampler_lib.CacheConfig(
        cache_size=prompt_len + n, num_layers=tcfg.num_layers, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim
    )
    sampler = sampler_lib.Sampler(model, _IdTokenizer(eos=cfg.vocab_size, pad=0), cache)

    def theirs():  # greedy: top_p None; the EOS id is outside the vocabulary, so exactly n tokens per row
        return sampler(
            texts, max_generation_steps=n, max_prompt_length=prompt_len, temperature=0.0, eos_tokens=[cfg.vocab_size]
        )

    t = _median_times(runs | {"tunix": theirs}, reps)
    agree = float(np.mean(np.asarray(runs["ours"]()) == np.stack(theirs().tokens)))
    return {
        **{f"generate_vs_tunix{side.removeprefix('ours')}": t["tunix"] / t[side] for side in meshes},
        **esroll_rates(t),
        "tunix_tokens_per_s": generated / t["tunix"],
        "greedy_token_agreement": agree,
        **esroll_figures,
        "tunix_devices": 1,
        "tunix_version": getattr(tunix, "__version__", "unknown"),
        "unmatched": "Tunix on one device (no mesh given); esroll on the devices its trainers use for this model "
        "(the _split / _1device figures: the other layout); a generated token equal to the pad id (0) is masked from "
        "later attention in Tunix only",
    }


def grpo_step_vs_tunix(args) -> dict:
    """Full GRPO steps (`_idtask.GRPO_SIZES`: 8 prompts × 8 completions, 64 new tokens, 32-token prompts), μ = 1,
    β = 0, ε = 0.2, one minibatch, sequence-mean-token-mean loss, temperature 1, the `configs/default.py:grpo` AdamW
    (the same optax transformation on both sides); esroll without remat (as Tunix) and with chunked
    log-probabilities. One Tunix step (`learner.train` on one batch) then one esroll step, after warm-up steps."""
    if not args.no_peers and (reason := _missing()):
        return {"grpo_step_vs_tunix": None, "reason": reason}
    X, G, n, prompt_len, warmup, timed = _idtask.GRPO_SIZES["quick" if args.quick else "full"]
    name = shape_name(args)
    with tempfile.TemporaryDirectory() as folder:
        model_cfg, params = _idtask.save_model(folder, name)
        cfg = _idtask.grpo_config(folder, X, G, n, args.grpo_remat)
        if not args.no_peers:
            from tunix.utils.mesh import create_mesh

            tmesh = create_mesh((1, 1), ("fsdp", "tp"))
            with jax.set_mesh(tmesh):
                _, actor = _tunix_model(folder, mesh=tmesh)
    g = cfg.grpo
    steps = warmup + timed
    batches = [_idtask.prompts(model_cfg.vocab_size, X, prompt_len, seed=i) for i in range(steps)]
    meshes = _idtask.esroll_meshes(params)  # as esroll's trainers run this model, and the other layout
    steppers = {
        side: _idtask.grpo_stepper(cfg, model_cfg, params, batches, prompt_len, m) for side, m in meshes.items()
    }
    context = _idtask.grpo_context(name, cfg, prompt_len, warmup, timed, meshes)
    if args.no_peers:
        log = _idtask.run_steppers_alone(steppers, steps)
        return _idtask.ours_only("grpo_step_vs_tunix", _idtask.esroll_grpo_figures(log, steppers, warmup, context))
    import tunix
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    # Tunix: rollout, reference and actor share one mesh (and so the actor's weights).
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=None,
        tokenizer=_IdTokenizer(eos=model_cfg.vocab_size, pad=0),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: tmesh for r in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=make_optimizer(cfg.optimizer),
                eval_every_n_steps=10**9,
                max_steps=10**6,
                mini_batch_size=None,
                train_micro_batch_size=None,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=n,
                max_prompt_length=prompt_len,
                kv_cache_size=prompt_len + n,
                temperature=g.temperature,
                top_p=1.0,
                top_k=None,
                seed=0,
                eos_tokens=[model_cfg.vocab_size],
            ),
        ),
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=G, num_iterations=1, beta=0.0, epsilon=g.epsilon_low, loss_agg_mode="sequence-mean-token-mean"
    )
    produced = []

    def reward(prompts, completions, **_):
        produced.append(sum(len(c.split()) for c in completions))
        return _idtask.reward_from_text(completions)

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward])
    # Tunix's vanilla rollout samples every step with the same seed: give each step its own, as esroll does.
    seeds, rollout = itertools.count(1), cluster.rollout.generate
    cluster.rollout.generate = lambda p, rc, **k: rollout(p, dataclasses.replace(rc, seed=next(seeds)), **k)

    log = {f"{side}_{k}": [] for side in ("tunix", *steppers) for k in ("s", "tokens")}
    for i in range(steps):
        start = time.perf_counter()
        learner.train([{"prompts": np.array(batches[i])}])
        log["tunix_s"].append(time.perf_counter() - start)
        log["tunix_tokens"].append(produced[-1])
        _idtask.run_steppers(steppers, i, log)
    ours = {side: _idtask.step_rate(log, side, warmup) for side in steppers}
    tunix_rate = _idtask.step_rate(log, "tunix", warmup)
    return {
        **{f"grpo_step_vs_tunix{side.removeprefix('ours')}": v / tunix_rate for side, v in ours.items()},
        "tunix_tokens_per_s": tunix_rate,
        **_idtask.esroll_grpo_figures(log, steppers, warmup, context),
        "tunix_step_s": log["tunix_s"][warmup:],
        "tunix_completion_tokens_per_step": log["tunix_tokens"][warmup],
        "tunix_devices": tmesh.size,
        "tunix_version": getattr(tunix, "__version__", "unknown"),
        "unmatched": "Tunix on a 1 × 1 mesh (as its CPU examples run); esroll on the devices its trainers use for "
        "this model (the _split / _1device figures: the other layout); advantage std epsilon 1e-6 (Tunix) vs 1e-4; "
        "neither rematerialises unless --grpo_remat is given (Tunix cannot)",
        "timing": "median completion tokens/s over timed steps, one Tunix step then one esroll step on each mesh, "
        "after warm-up",
    }


BENCHMARKS = {"generate_vs_tunix": generate_vs_tunix, "grpo_step_vs_tunix": grpo_step_vs_tunix}
