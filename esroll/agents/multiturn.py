"""Multi-turn episodes in one KV cache: a batch of episodes played in lockstep, each turn decoding the model's action
into the cache and then appending the environment's answer, so that no turn re-reads (or re-tokenises) what came
before.

    episodes = play(cfg, params, tokenizer, envs, seeds, key, max_turns=8)

An episode's text is its prompt, `episode_prompt(env.instructions, first observation)`, then per turn the model's
action (its sampled tokens, up to and including the end token, kept exactly as sampled) and the environment's answer
(`format_observation`: the observation and a newline, tokenised). The model's tokens get loss (`Episodes.loss_mask`);
the prompt's and the environment's never do. An episode that ends (solved, failed, or out of turns) stops: its rows
decode nothing more and its cache slots stay empty (masked), while the others go on.

Per-member perturbations work as in single-turn decoding (`perturb`, `member_B`): each row sees its member's weights
in every forward of every turn. Sampling noise is drawn per (key, turn, global row, step), the global row being
`row_offset` + b, so a caller that plays rows of a larger batch in chunks gets the tokens the whole batch would.
`actions` replaces the model's choice by given texts (a scripted policy, teacher forcing): the texts' tokens and the
end token go through the same cache, and their log-probabilities under the model are recorded.

The cache holds `P − 1 + W·(O + N)` slots: the padded prompt but its last token, and per turn an input of at most
O + 1 tokens (the previous action's last token if it is not cached yet, and an observation of at most
`max_observation_tokens`, O) of which all but the last are cached before decoding, then `max_action_tokens` (N)
decode steps; unused slots are masked. One program serves every turn (the turn is traced).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.agents.base import TextEnv
from esroll.agents.reflect import HEADER_TOKENS, reflection_header
from esroll.errors import InputError
from esroll.models import ModelConfig, Perturbation, forward, init_cache
from esroll.models.layers import table_slots
from esroll.sampling import draw, pad_prompts

Array = jax.Array
ENV, ACTION, REFLECTION = 0, 1, 2  # the kinds of an episode's pieces: the environment's text, an action, a reflection


def episode_prompt(instructions: str, observation: str) -> str:
    """An episode's first text: the environment's instructions, then its first observation and a newline."""
    return f"{instructions}\n{format_observation(observation)}"


def format_observation(observation: str) -> str:
    """The environment's answer to an action, as the episode's text continues after the action's end token."""
    return f"{observation}\n"


class Turns(NamedTuple):
    """Each episode's turns, B rows and W turn slots, as turn-level credit reads them (`esroll.grpo.estimators.turns`):
    the span of turn t's action in the episode after its prompt (start_BxW, end_BxW), its reward, the turns played
    (count_B), the observation each action answered (states[b][t], the text the environment showed before it), the
    action texts as the environment read them (actions[b][t]) and whether the episode ended solved (solved_B, the
    environment's `solved`). The last two are None where a caller built turns without them, and so are the
    reflection's text and span (`play(reflect_tokens=...)`: RePro's ratings after the episode) without one."""

    start_BxW: np.ndarray
    end_BxW: np.ndarray
    reward_BxW: np.ndarray
    count_B: np.ndarray
    states: list[list[str]]
    actions: list[list[str]] | None = None
    solved_B: np.ndarray | None = None
    reflections: list[str] | None = None
    reflection_start_B: np.ndarray | None = None
    reflection_end_B: np.ndarray | None = None

    def spans(self, b: int) -> list[tuple[int, int, int, float]]:
        """(turn, start, end, reward) of each turn row b played whose action has a token (a turn with none is
        skipped: the rollout produces none), in order."""
        count = int(self.count_B[b])
        rows = zip(self.start_BxW[b, :count], self.end_BxW[b, :count], self.reward_BxW[b, :count])
        return [(w, int(s), int(e), float(r)) for w, (s, e, r) in enumerate(rows) if e > s]


@dataclasses.dataclass
class Episodes:
    """Episodes played in lockstep, B rows (host arrays). L = the longest episode's tokens after its prompt.

    tokens_BxT: the episode after the prompt, actions and observations interleaved, `pad_id` after its end;
    loss_mask_BxT: True on the model's tokens (the actions), never on the environment's; logprobs_BxT: log π of each
    action token under the model (temperature 1, as `esroll.sampling.Generation`), 0 elsewhere; length_B: tokens
    after the prompt; prompt_BxP / prompt_mask_BxP: the left-padded prompts. Turn t of row b: its action is
    tokens[b, action_start[b, t] : action_end[b, t]], its answer follows up to the next action's start;
    reward_BxW, valid_BxW (the action parsed, `esroll.agents.parse_action`), turns_B (turns played); done_B (ended by
    the environment or its turn limit, not cut by `max_turns`); solved_B (the environment's `solved` at the end);
    observations: each row's observation texts, the first one and one per turn; actions: the action texts as the
    environment read them. return_B: the sum of the rewards. With a reflection (`play(reflect_tokens=...)`):
    its span reflection_start_B .. reflection_end_B (model tokens, with loss) after the header the environment wrote
    (`esroll.agents.reflect.reflection_header`), and its text (`reflections`); None without one."""

    prompt_BxP: np.ndarray
    prompt_mask_BxP: np.ndarray
    tokens_BxT: np.ndarray
    loss_mask_BxT: np.ndarray
    logprobs_BxT: np.ndarray
    length_B: np.ndarray
    action_start_BxW: np.ndarray
    action_end_BxW: np.ndarray
    reward_BxW: np.ndarray
    valid_BxW: np.ndarray
    turns_B: np.ndarray
    done_B: np.ndarray
    solved_B: np.ndarray
    observations: list[list[str]]
    actions: list[list[str]]
    reflection_start_B: np.ndarray | None = None
    reflection_end_B: np.ndarray | None = None
    reflections: list[str] | None = None

    @property
    def return_B(self) -> np.ndarray:
        return self.reward_BxW.sum(axis=1)

    @property
    def turns(self) -> Turns:
        """The turns as turn-level credit reads them (the observation before each action as its state)."""
        states = [obs[: int(n)] for obs, n in zip(self.observations, self.turns_B)]
        return Turns(
            self.action_start_BxW,
            self.action_end_BxW,
            self.reward_BxW,
            self.turns_B,
            states,
            self.actions,
            self.solved_B,
            self.reflections,
            self.reflection_start_B,
            self.reflection_end_B,
        )


def play(
    cfg: ModelConfig,
    params: dict,
    tokenizer,
    envs: Sequence[TextEnv],
    seeds: Sequence[int],
    key: Array,
    *,
    max_turns: int,
    max_action_tokens: int = 8,
    max_observation_tokens: int = 64,
    temperature: float = 1.0,
    eos_id: int,
    pad_id: int,
    perturb: Perturbation | None = None,
    row_offset: int = 0,
    actions: Callable[[int, list[str]], list[str]] | None = None,
    prompt_multiple: int = 16,
    member_slots: int | None = None,
    reflect_tokens: int = 0,
) -> Episodes:
    """Play `envs[b]` from `seeds[b]` for every row b, at most `max_turns` turns, in one KV cache per row.

    `perturb` (its `member_B` mapping rows to members) perturbs every forward. `actions(turn, observations)` — the
    current observation of every row — returns each row's action text (a scripted policy); without it the model
    samples at `temperature` (0: greedy); a given text is cut to `max_action_tokens` − 1 tokens before its end token.
    An observation longer than `max_observation_tokens` tokens is refused (a ValueError naming the option): the
    cache's size is fixed before the first turn.

    A member-level `perturb` becomes member tables once, before the first turn (`Perturbation.tables`, of
    `member_slots` entries: by default the rows' distinct members; a caller that plays chunks passes the bound of all
    of them, so that they share one compilation)."""
    B, W, N, O = len(envs), max_turns, max_action_tokens, max_observation_tokens
    first = [env.reset(int(seed)) for env, seed in zip(envs, seeds)]
    prompts = [
        tokenizer.encode(episode_prompt(env.instructions, o), add_special_tokens=False) for env, o in zip(envs, first)
    ]
    prompt_BxP, prompt_mask_BxP = pad_prompts(prompts, multiple=prompt_multiple, pad_id=pad_id)
    P = prompt_BxP.shape[1]
    H = O + HEADER_TOKENS  # the reflection's header
    slots = P - 1 + W * (O + N)  # the prompt but its last token; per turn O of the input's O + 1, then N decoded
    slots += H + reflect_tokens if reflect_tokens else 0
    if perturb is not None and perturb.member_B is not None:  # the factors gathered once for every turn
        entries = table_slots(np.asarray(perturb.member_B), B, 1, member_slots, "play")
        perturb = _factors(perturb, entries)
    cache = _start(cfg, params, jnp.asarray(prompt_BxP), jnp.asarray(prompt_mask_BxP), perturb, slots=slots)
    observations = [[o] for o in first]
    acted: list[list[str]] = [[] for _ in range(B)]
    pieces: list[list[tuple[list[int], list[float], int]]] = [[] for _ in range(B)]  # (tokens, logprobs, kind)
    reward_BxW, valid_BxW = np.zeros((B, W), np.float32), np.zeros((B, W), bool)
    turns_B, live_B = np.zeros(B, np.int32), np.ones(B, bool)
    # The next input of each row: what the cache has not seen yet (left-padded to O + 1; the last column is real).
    input_rows = [[p[-1]] for p in prompts]
    tail: list[list[int]] = [[] for _ in range(B)]  # each row's last action token when it is not cached yet
    for turn in range(W):
        inputs_BxT, inputs_mask_BxT = _left_pad(input_rows, O + 1, pad_id, live_B)
        forced_BxN, forced_len_B = np.zeros((B, N), np.int32), np.zeros(B, np.int32)
        if actions is not None:
            texts = actions(turn, [obs[-1] for obs in observations])
            for b in np.flatnonzero(live_B):
                ids = tokenizer.encode(texts[b], add_special_tokens=False)[: N - 1] + [eos_id]
                forced_BxN[b, : len(ids)], forced_len_B[b] = ids, len(ids)
        cache, out = _turn(
            cfg,
            params,
            cache,
            jnp.asarray(inputs_BxT),
            jnp.asarray(inputs_mask_BxT),
            jax.random.fold_in(key, turn),
            perturb,
            jnp.asarray(row_offset, jnp.int32),
            jnp.asarray(live_B),
            jnp.asarray(forced_BxN),
            jnp.asarray(forced_len_B),
            eos_id=eos_id,
            pad_id=pad_id,
            max_action_tokens=N,
            temperature=temperature,
            forced=actions is not None,
        )
        tokens_BxN, logprobs_BxN, length_B = (np.asarray(x) for x in out)
        input_rows = [[] for _ in range(B)]
        for b in np.flatnonzero(live_B):
            n = int(length_B[b])
            ids = [int(i) for i in tokens_BxN[b, :n]]
            pieces[b].append((ids, [float(x) for x in logprobs_BxN[b, :n]], ACTION))
            text = tokenizer.decode([i for i in ids if i != eos_id], skip_special_tokens=False)
            step = envs[b].step(text)
            acted[b].append(text)
            observations[b].append(step.observation)
            reward_BxW[b, turn], valid_BxW[b, turn], turns_B[b] = step.reward, step.valid, turn + 1
            tail[b] = ids[-1:] if n == N else []
            if step.done:
                live_B[b] = False
                continue
            answer = tokenizer.encode(format_observation(step.observation), add_special_tokens=False)
            if len(answer) > O:
                raise InputError(
                    f"env.max_observation_tokens: an observation of {len(answer)} tokens does not fit its {O} (turn "
                    f"{turn}, row {b}: {step.observation[:40]!r}...): raise it or shorten the environment's observations"
                )
            pieces[b].append((answer, [0.0] * len(answer), ENV))
            # The decode loop feeds each drawn token back at its next step: an action that used all N steps still
            # has its last token to cache; a shorter one ended with the end token, which was fed back.
            input_rows[b] = ids[-1:] + answer if n == N else answer
        if not live_B.any():
            break
    solved_B = np.array([bool(env.solved) for env in envs])
    done_B = ~live_B
    reflections = None
    if reflect_tokens:
        for b in np.flatnonzero(live_B):  # cut by `max_turns`: the header repeats the last answer, never cached
            pieces[b].pop()
        reflections = _reflect(
            cfg, params, cache, tokenizer, pieces, tail, observations, solved_B, jax.random.fold_in(key, W), perturb,
            row_offset, H, reflect_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
        )  # fmt: skip
    return _assemble(prompt_BxP, prompt_mask_BxP, pieces, reward_BxW, valid_BxW, turns_B, done_B, solved_B, pad_id,
                     observations, acted, reflections)  # fmt: skip


def _reflect(cfg, params, cache, tokenizer, pieces, tail, observations, solved_B, key, perturb, row_offset, H, R, *,
             eos_id, pad_id, temperature) -> list[str]:  # fmt: skip
    """Every row's reflection, decoded after its episode in the same cache: the header (environment tokens) then at
    most R model tokens. Appends both to `pieces` and returns the reflections' texts."""
    B = len(pieces)
    rows = []
    for b in range(B):
        header = tokenizer.encode(reflection_header(observations[b][-1], bool(solved_B[b])), add_special_tokens=False)
        if len(header) > H:
            raise InputError(
                f"env.max_observation_tokens: a reflection header of {len(header)} tokens does not fit its {H} (row "
                f"{b}: {observations[b][-1][:40]!r}...): raise it or shorten the environment's observations"
            )
        pieces[b].append((header, [0.0] * len(header), ENV))
        rows.append(tail[b] + header)
    live_B = np.ones(B, bool)
    inputs_BxT, inputs_mask_BxT = _left_pad(rows, H + 1, pad_id, live_B)
    none_BxR = jnp.zeros((B, R), jnp.int32)
    _, out = _turn(
        cfg, params, cache, jnp.asarray(inputs_BxT), jnp.asarray(inputs_mask_BxT), key, perturb,
        jnp.asarray(row_offset, jnp.int32), jnp.asarray(live_B), none_BxR, jnp.zeros(B, jnp.int32),
        eos_id=eos_id, pad_id=pad_id, max_action_tokens=R, temperature=temperature, forced=False,
    )  # fmt: skip
    tokens_BxR, logprobs_BxR, length_B = (np.asarray(x) for x in out)
    texts = []
    for b in range(B):
        n = int(length_B[b])
        ids = [int(i) for i in tokens_BxR[b, :n]]
        pieces[b].append((ids, [float(x) for x in logprobs_BxR[b, :n]], REFLECTION))
        texts.append(tokenizer.decode([i for i in ids if i != eos_id], skip_special_tokens=False))
    return texts


def _left_pad(rows: list[list[int]], width: int, pad_id: int, live_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = np.full((len(rows), width), pad_id, np.int32), np.zeros((len(rows), width), bool)
    for b, ids in enumerate(rows):
        if live_B[b] and ids:
            tokens[b, width - len(ids) :], mask[b, width - len(ids) :] = ids, True
    return tokens, mask


def _assemble(prompt_BxP, prompt_mask_BxP, pieces, reward_BxW, valid_BxW, turns_B, done_B, solved_B, pad_id, observations,
              acted, reflections=None):  # fmt: skip
    B, W = reward_BxW.shape
    L = max([sum(len(p[0]) for p in row) for row in pieces] + [1])
    tokens = np.full((B, L), pad_id, np.int32)
    loss, logp = np.zeros((B, L), bool), np.zeros((B, L), np.float32)
    start, end, length = np.zeros((B, W), np.int32), np.zeros((B, W), np.int32), np.zeros(B, np.int32)
    spans = np.zeros((2, B), np.int32)  # the reflection's start and end
    for b, row in enumerate(pieces):
        at, turn = 0, 0
        for ids, lps, kind in row:
            tokens[b, at : at + len(ids)] = ids
            if kind != ENV:
                loss[b, at : at + len(ids)] = True
                logp[b, at : at + len(ids)] = lps
            if kind == ACTION:
                start[b, turn], end[b, turn] = at, at + len(ids)
                turn += 1
            elif kind == REFLECTION:
                spans[:, b] = at, at + len(ids)
            at += len(ids)
        length[b] = at
    reflected = reflections is not None
    return Episodes(prompt_BxP, prompt_mask_BxP, tokens, loss, logp, length, start, end, reward_BxW, valid_BxW,
                    turns_B, done_B, solved_B, observations, acted, spans[0] if reflected else None,
                    spans[1] if reflected else None, reflections)  # fmt: skip


@functools.partial(jax.jit, static_argnames="slots")
def _factors(perturb: Perturbation, slots: int) -> Perturbation:
    """A member-level perturbation as member tables of `slots` entries (`Perturbation.tables`), or per row (0)."""
    return perturb.tables(slots) if slots else perturb.per_row()


@functools.partial(jax.jit, static_argnames=("cfg", "slots"))
def _start(cfg, params, prompt_BxP, mask_BxP, perturb, *, slots):
    """A cache of `slots` slots holding every prompt token but the last (the first turn's input)."""
    B = prompt_BxP.shape[0]
    cache = init_cache(cfg, B, slots, params["embed"].dtype)
    _, cache = forward(
        cfg, params, prompt_BxP[:, :-1], mask_BxT=mask_BxP[:, :-1], cache=cache, perturb=perturb, attend_slots=0
    )
    return cache


@functools.partial(jax.jit, static_argnames=("cfg", "pad_id", "eos_id", "max_action_tokens", "temperature", "forced"))
def _turn(cfg, params, cache, inputs_BxT, mask_BxT, key, perturb, row_offset, live_B, forced_BxN, forced_len_B, *,
          eos_id, pad_id, max_action_tokens, temperature, forced):  # fmt: skip
    """One turn of every row: cache the row's new input but its last token, then decode its action from that token
    (a live row's last input column is real), at most `max_action_tokens` tokens or through `eos_id`; with
    `forced`, the tokens are the given ones instead of samples. Returns the cache and (tokens, logprobs, lengths)."""
    B, N = inputs_BxT.shape[0], max_action_tokens
    run = functools.partial(forward, cfg, params, perturb=perturb)
    _, cache = run(inputs_BxT[:, :-1], mask_BxT=mask_BxT[:, :-1], cache=cache)
    rows_B = jnp.arange(B, dtype=jnp.int32) + row_offset

    def step(t, state):
        cache, token_B, real_B, tokens_BxN, logprobs_BxN, length_B, done_B = state
        logits_Bx1xV, cache = run(token_B[:, None], mask_BxT=real_B[:, None], cache=cache)
        given_B = forced_BxN[:, t] if forced else None
        new_B, logprob_B = draw(logits_Bx1xV[:, 0], jax.random.fold_in(key, t), rows_B, temperature, given_B=given_B)
        new_B = jnp.where(done_B, pad_id, new_B)
        tokens_BxN = tokens_BxN.at[:, t].set(new_B)
        logprobs_BxN = logprobs_BxN.at[:, t].set(jnp.where(done_B, 0.0, logprob_B))
        length_B = length_B + ~done_B
        real_B = ~done_B  # the token just drawn is fed back at the next step unless the row had already ended
        ended_B = new_B == eos_id
        if forced:  # the given tokens end with the end token; a shorter row is done at its length
            ended_B = ended_B | (t + 1 >= forced_len_B)
        done_B = done_B | ended_B
        return cache, new_B, real_B, tokens_BxN, logprobs_BxN, length_B, done_B

    state = (
        cache,
        inputs_BxT[:, -1],
        mask_BxT[:, -1] & live_B,
        jnp.full((B, N), pad_id, jnp.int32),
        jnp.zeros((B, N), jnp.float32),
        jnp.zeros((B,), jnp.int32),
        ~live_B,
    )
    cache, _, _, tokens_BxN, logprobs_BxN, length_B, _ = jax.lax.fori_loop(0, N, step, state)
    return cache, (tokens_BxN, logprobs_BxN, length_B)
