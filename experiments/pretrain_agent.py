"""Build the small agent model that ships with esroll (`assets/tiny-qwen3-agent`): one Qwen3-architecture decoder and
tokenizer for FrozenLake and Sokoban, trained with plain supervised learning on a planner's episodes, stopped while
it still fails often, so that ES and policy gradient have headroom.

    python -m experiments.pretrain_agent --out assets/tiny-qwen3-agent

Episodes: for each training seed of each environment, a planner plays the episode (each turn, the first move of a
shortest solution from the current state: `FrozenLake.plan`, `Sokoban.plan`), a random move instead with probability
--random_moves, and the episode's text is exactly what `esroll.agents.play` writes (`episode_prompt`, each action
and the end token, `format_observation`). The loss is on the actions' tokens only, as in the multi-turn rollout.
Training seeds are [0, --episodes); held-out seeds start at 1,000,000, so no held-out level is trained on.

Every --eval_every steps, greedy play (`esroll.agents.play`, temperature 0) on --eval_episodes held-out seeds of
each environment measures the success rate (FrozenLake: reached G; Sokoban: solved); training stops at the first
evaluation whose success on the first of --envs is at least --stop_at, or after --max_steps. The model's
`max_position_embeddings` covers the longest episode of any of its environments. Deterministic from --seed.

A model for your own environment: register it (`esroll.agents.register_env`, docs/extending.md) in a module that
--module imports, give it the planner hook, a method `plan()` that returns the actions of a shortest solution from
the current state (a tuple of action words; empty or None where there is none), and name it in --envs:

    python -m experiments.pretrain_agent --module my_envs --envs corridor --out runs/corridor-model

Each environment plays at its registered default options.

The reflecting agent model (`assets/tiny-qwen3-reflect`, RePro's: `configs/agents.py:repro`) is built the same way
with --reflect F: a share F of the training episodes is followed by its reflection demonstration, what
`esroll.agents.play(reflect_tokens=...)` writes after an episode (`reflection_header`: the final observation and
the outcome) and then the exact ratings of the moves (`oracle_ratings`, one "+", "0" or "-" per move, with loss)
and the end token: the warm-up that teaches the reflection's format. Which episodes get one is drawn from its own
stream, so the episodes and batches are those of the build without it. Each evaluation then also plays every
held-out episode's reflection greedily and reports the share whose ratings parse and their agreement with the
oracle's.

    python -m experiments.pretrain_agent --reflect 1 --out assets/tiny-qwen3-reflect
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

from esroll.agents import ENVIRONMENTS, make_env
from esroll.models import save_hf
from esroll.agents.multiturn import format_observation, episode_prompt, play
from esroll.agents.reflect import (
    HEADER_TOKENS,
    format_ratings,
    oracle_ratings,
    reflection_header,
    reflection_room,
    score_reflections,
)
from experiments.pretrain_tiny import EOS, build_tokenizer, init_params, model_config, supervised_step

HELD_OUT = 1_000_000  # the first held-out seed
BUILT_IN = ("frozenlake", "sokoban")  # the shipped model's environments, in its build's order
MAX_ACTION_TOKENS = 4  # an action word and the end token, with room to spare (configs/agents.py uses the same)
MAX_OBSERVATION_TOKENS = 24  # the builder refuses a tokenizer that writes a longer answer (configs/agents.py's room)


def max_turns(name: str) -> int:
    """The turn limit of environment `name` at its registered default options."""
    return ENVIRONMENTS.options_of({}, name).max_turns


def reflect_tokens(name: str) -> int:
    """The reflection's room in environment `name` (`reflection_room`, as configs/agents.py gives it)."""
    return reflection_room(max_turns(name))


def planner_episode(name: str, seed: int, rng: np.random.Generator, random_moves: float,
                    reflect: bool = False) -> list[tuple[str, bool]]:  # fmt: skip
    """The planner's episode of `seed` as (text, is_action) pieces: the prompt, then each action and answer; with
    `reflect`, then the reflection's header and the oracle's ratings (a piece with loss, as an action)."""
    env = make_env(name)
    observation = env.reset(seed)
    pieces = [(episode_prompt(env.instructions, observation), False)]
    actions = []
    for _ in range(max_turns(name)):
        plan = env.plan()
        if plan and rng.random() >= random_moves:
            action = plan[0]
        else:
            action = env.actions[int(rng.integers(len(env.actions)))]
        turn = env.step(action)
        pieces.append((action, True))
        actions.append(action)
        if turn.done:
            break
        pieces.append((format_observation(turn.observation), False))
    if reflect:
        pieces.append((reflection_header(turn.observation, env.solved), False))
        pieces.append((format_ratings(oracle_ratings(make_env(name), seed, actions)), True))
    return pieces


def encode(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of an episode: each action's tokens and the end token after it get loss."""
    ids, loss = [], []
    for text, is_action in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if is_action else [])
        ids += piece
        loss += [is_action] * len(piece)
    return ids, loss


def success_rates(cfg, params, tokenizer, episodes: int, names: tuple[str, ...] = BUILT_IN,
                  reflect: bool = False) -> dict[str, float]:  # fmt: skip
    """Greedy play on the held-out seeds: each environment's success rate, mean turns and tokens per episode; with
    `reflect`, each episode's reflection too: the share whose ratings parse and their agreement with the oracle's."""
    out = {}
    for name in names:
        envs = [make_env(name) for _ in range(episodes)]
        seeds = range(HELD_OUT, HELD_OUT + episodes)
        ep = play(
            cfg, params, tokenizer, envs, seeds, jax.random.key(0),
            max_turns=max_turns(name), max_action_tokens=MAX_ACTION_TOKENS,
            max_observation_tokens=MAX_OBSERVATION_TOKENS, temperature=0.0, eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id, reflect_tokens=reflect_tokens(name) if reflect else 0,
        )  # fmt: skip
        out[f"{name}_success"] = float(ep.solved_B.mean())
        out[f"{name}_turns"] = float(ep.turns_B.mean())
        out[f"{name}_tokens"] = float((ep.length_B + ep.prompt_mask_BxP.sum(1)).mean())
        out[f"{name}_valid_actions"] = float(ep.valid_BxW[ep.action_end_BxW > 0].mean())
        if reflect:  # as the rollout's metrics (`score_reflections`)
            scored = score_reflections(make_env(name), list(seeds), ep.reflections, ep.actions, ep.turns_B)
            out.update({f"{name}_{key}": value for key, value in scored.items()})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", type=Path, default=Path("assets/tiny-qwen3-agent"), help="folder to write the model and tokenizer to")
    add("--seed", type=int, default=0, help="initialisation, planner and batch-order seed")
    add("--episodes", type=int, default=4000, help="training episodes per environment")
    add("--random_moves", type=float, default=0.25, help="probability of a random move instead of the planner's")
    add("--batch", type=int, default=32, help="training episodes per step")
    add("--lr", type=float, default=2e-3, help="AdamW learning rate (warm-up, then cosine to --max_steps)")
    add("--max_steps", type=int, default=3000, help="stop after this many steps if --stop_at is not reached")
    add("--eval_every", type=int, default=100, help="steps between held-out evaluations")
    add("--eval_episodes", type=int, default=64, help="held-out episodes per environment per evaluation")
    add("--stop_at", type=float, default=0.4, help="stop at the first evaluation with this FrozenLake success rate")
    add("--vocab", type=int, default=512, help="BPE vocabulary size of the tokenizer (256 bytes, then merges)")
    add("--hidden", type=int, default=128, help="hidden size (4 heads of 32, 2 kv heads)")
    add("--layers", type=int, default=4, help="decoder layers")
    add("--envs", default=",".join(BUILT_IN), help="registered environments to learn, comma-separated")
    add("--reflect", type=float, default=0.0, help="share of training episodes followed by a reflection (RePro)")
    add("--module", action="append", default=[], help="a module to import first (one that registers --envs)")
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        parser.error(f"--out: the folder {args.out.parent} does not exist")
    for module in args.module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            parser.error(f"--module: cannot import {module}: {e}")
    envs = tuple(n.strip() for n in args.envs.split(",") if n.strip())
    for name in envs:
        if name not in ENVIRONMENTS:
            parser.error(f"--envs: no environment {name!r} is registered (expected one of {', '.join(ENVIRONMENTS)})")
        if not callable(getattr(make_env(name), "plan", None)):
            parser.error(f"--envs: environment {name!r} has no plan() method, the planner the episodes come from")
    if not envs:
        parser.error("--envs: name at least one environment")
    if not 0 <= args.reflect <= 1:
        parser.error(f"--reflect: {args.reflect} is not a share in [0, 1]")

    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    reflecting = np.random.default_rng([args.seed, 1]).random(args.episodes * len(envs)) < args.reflect
    episodes = [
        planner_episode(n, s, rng, args.random_moves, bool(reflecting[s * len(envs) + e]))
        for s in range(args.episodes)
        for e, n in enumerate(envs)
    ]
    tokenizer = build_tokenizer(["".join(t for t, _ in ep) for ep in episodes[:4000]], args.vocab)
    encoded = [encode(tokenizer, ep) for ep in episodes]
    answers = [t for ep in episodes for t, is_action in ep[1:] if not is_action and not t.endswith("Progress:\n")]
    longest_answer = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in answers)
    if longest_answer > MAX_OBSERVATION_TOKENS:
        parser.error(f"--vocab: an answer takes {longest_answer} tokens, above the {MAX_OBSERVATION_TOKENS} room")
    # The longest episode either environment can give: its prompt and every turn's action and answer at their caps.
    longest_prompt = max(len(tokenizer.encode(ep[0][0], add_special_tokens=False)) for ep in episodes)
    turns = max(max_turns(name) for name in envs)
    longest = longest_prompt + turns * (MAX_ACTION_TOKENS + MAX_OBSERVATION_TOKENS + 1)
    if args.reflect:  # the reflection's header and ratings
        longest += MAX_OBSERVATION_TOKENS + HEADER_TOKENS + max(reflect_tokens(name) for name in envs)
    positions = 64 * -(-longest // 64)
    cfg = dataclasses.replace(
        model_config(len(tokenizer), tokenizer.eos_token_id),
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        max_position_embeddings=positions,
    )
    # One array per environment, padded to its longest episode: a batch is drawn from one environment at a time
    # (alternating), so a short FrozenLake episode is not padded to a Sokoban one's length.
    data = []
    for e in range(len(envs)):
        rows = encoded[e :: len(envs)]  # episodes alternate environments
        length = max(len(ids) for ids, _ in rows)
        tokens = np.full((len(rows), length), tokenizer.eos_token_id, np.int32)
        mask, target = np.zeros_like(tokens, bool), np.zeros_like(tokens, bool)
        for i, (ids, loss) in enumerate(rows):
            tokens[i, : len(ids)], mask[i, : len(ids)], target[i, : len(ids)] = ids, True, loss
        data.append((tokens, mask, target))

    params = init_params(cfg, jax.random.key(args.seed))
    warmup = min(100, args.max_steps // 2)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.max_steps), weight_decay=0.01)
    opt_state = opt.init(params)

    step = supervised_step(cfg, opt)

    history = []
    for i in range(1, args.max_steps + 1):
        tokens, mask, target = data[i % len(data)]
        idx = rng.integers(0, len(tokens), args.batch)
        params, opt_state, loss = step(params, opt_state, tokens[idx], mask[idx], target[idx])
        if i % args.eval_every == 0:
            figures = success_rates(cfg, params, tokenizer, args.eval_episodes, envs, reflect=args.reflect > 0)
            history.append({"step": i, "train_loss": float(loss), **figures})
            print(f"step {i:5d}  loss {float(loss):.3f}  " + "  ".join(f"{k} {v:.3f}" for k, v in figures.items()),
                  flush=True)  # fmt: skip
            if figures[f"{envs[0]}_success"] >= args.stop_at:
                break
    save_hf(args.out, cfg, params, tokenizer=tokenizer)
    summary = {
        "command": "python -m experiments.pretrain_agent " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.perf_counter() - start, 1),
        "seed": args.seed,
        "steps": history[-1]["step"] if history else 0,
        **(history[-1] if history else {}),
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
        "max_position_embeddings": positions,
        "vocab": len(tokenizer),
        "longest_answer_tokens": longest_answer,
        "episode_tokens": {name: int(d[0].shape[1]) for name, d in zip(envs, data)},
        "train_episodes_per_env": args.episodes,
        "held_out_episodes_per_env": args.eval_episodes,
        "eos": EOS,
        "history": history,
    }
    (args.out / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"saved {args.out} ({summary['parameters']} parameters)")
    return summary


if __name__ == "__main__":
    main()
