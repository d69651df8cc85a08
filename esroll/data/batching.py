"""Held-out splits and prompt batches as pure functions of (seed, step), so resuming needs only the step.

The prompt stream is the concatenation of one permutation per epoch, permutation `e` drawn from a numpy Generator
seeded with (seed, e); batch `step` is the slice [step * batch_size, (step + 1) * batch_size) of that stream. A batch
that straddles an epoch boundary wraps into the next epoch's permutation: nothing is dropped, every example appears
exactly once per epoch, and such a batch may hold the same example twice (end of one epoch, start of the next).
"""

from typing import Sequence

import numpy as np

from esroll.data.tasks import Example


def epoch_permutation(n_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of examples in `epoch`."""
    return np.random.default_rng([seed, epoch]).permutation(n_examples)


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Example indices of the batch at global `step`, shape [batch_size]."""
    if n_examples < 1 or batch_size < 1 or seed < 0 or step < 0:
        raise ValueError(f"need positive sizes, non-negative seed, step: {n_examples=} {batch_size=} {seed=} {step=}")
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // n_examples
    indices = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        indices[in_epoch] = epoch_permutation(n_examples, seed, int(epoch))[positions[in_epoch] % n_examples]
    return indices


def get_batch(examples: Sequence[Example], batch_size: int, seed: int, step: int) -> list[Example]:
    """The examples of the batch at global `step`."""
    return [examples[i] for i in batch_indices(len(examples), batch_size, seed, step)]


def split_examples(examples: Sequence[Example], n_eval: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A deterministic (train, held-out) split with no prompt in both.

    Held-out gets the first `n_eval` distinct prompts of a seeded shuffle; train gets every row whose prompt is not
    held out (duplicates of a held-out prompt are dropped, not leaked). Both keep the input order.
    """
    distinct = list(dict.fromkeys(e.prompt for e in examples))
    if not 0 <= n_eval <= len(distinct):
        raise ValueError(f"n_eval={n_eval} must be in [0, {len(distinct)}] (the number of distinct prompts)")
    order = np.random.default_rng(seed).permutation(len(distinct))
    held_out = {distinct[i] for i in order[:n_eval]}
    seen: set[str] = set()
    train, evaluation = [], []
    for example in examples:
        if example.prompt not in held_out:
            train.append(example)
        elif example.prompt not in seen:
            seen.add(example.prompt)
            evaluation.append(example)
    return train, evaluation
