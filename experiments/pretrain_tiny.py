"""Build the small models that ship with esroll: Qwen3-architecture decoders and tokenizers trained with plain
supervised learning on a synthetic task, stopped mid-way so ES and GRPO have clear headroom.

    python -m experiments.pretrain_tiny --out assets/tiny-qwen3-arith
    python -m experiments.pretrain_tiny --task arith_steps --out assets/tiny-qwen3-steps \\
        --batch 64 --lr 2e-3 --eval_every 50 --stop_at 0.3 --max_steps 3000
    python -m experiments.pretrain_tiny --task arith_steps --out assets/tiny-qwen3-steps-teacher \\
        --batch 64 --lr 2e-3 --eval_every 50 --stop_at 0.75 --max_steps 3000 --tokenizer assets/tiny-qwen3-steps

The first answers 2-digit sums with the bare number; the second writes worked solutions, one equation per line ending
in "#### n" (`data.task = "arith_steps"`), so that step-level credit has steps to credit. The third is the second's
teacher: the same run (seed, data order, schedule) carried on to a held-out exact match of 75%, with the student's
tokenizer (`--tokenizer`), so that its log-probabilities score the student's tokens one for one.

Deterministic from --seed. Training stops at the first evaluation whose held-out exact match reaches --stop_at or
after --max_steps. The held-out questions are the same ones the default experiment's data section gives for --task
(`esroll.data.make_splits`), so they are never trained on. Exact match is measured with teacher forcing: every answer
token (and the EOS) is the argmax, which is the same event as greedy decoding producing the answer exactly. The
summary also records, for the saved model, the greedy held-out accuracy by the task's own scorer (a worked solution
may reach the right answer through a wrong line, so it is at least the exact match) and, for a task whose answers are
worked one line per step, the fraction of completions with a wrong line, right and wrong final answers apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from esroll.config import from_config_dict
from esroll.data import PLAIN_TEMPLATE, Example, make_splits, score
from esroll.experiment import check_names, default_config
from esroll.models import ModelConfig, forward, param_shapes, save_hf
from esroll.sampling import generate, pad_prompts

EOS = "<|endoftext|>"


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with single-digit tokens (so numbers are spelled digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def model_config(vocab_size: int, eos_id: int) -> ModelConfig:
    hf = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "torch_dtype": "float32"}
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        qk_norm=True,
        hf_json=json.dumps(hf),
    )


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Normal(0, std) matrices and embeddings, unit norm scales (the Hugging Face initialisation)."""
    shapes = param_shapes(cfg)

    def init(path, shape):
        name = jax.tree_util.keystr(path)
        leaf_key = jax.random.fold_in(key, zlib.crc32(name.encode()))
        return jnp.ones(shape) if "norm" in name else std * jax.random.normal(leaf_key, shape)

    return jax.tree_util.tree_map_with_path(init, shapes, is_leaf=lambda s: isinstance(s, tuple))


def encode_supervised(tokenizer, examples: list[Example], length: int) -> tuple[np.ndarray, ...]:
    """Left-padded prompt + target + EOS rows; the loss mask covers the target and the EOS."""
    tokens = np.full((len(examples), length), tokenizer.eos_token_id, np.int32)
    mask = np.zeros((len(examples), length), bool)
    target = np.zeros((len(examples), length), bool)
    for row, ex in enumerate(examples):
        prompt = tokenizer.encode(PLAIN_TEMPLATE.format(question=ex.prompt))
        answer = tokenizer.encode(ex.target_text) + [tokenizer.eos_token_id]
        ids = prompt + answer
        if len(ids) > length:
            raise ValueError(f"example {ex.prompt!r} needs {len(ids)} tokens > {length}")
        tokens[row, length - len(ids) :] = ids
        mask[row, length - len(ids) :] = True
        target[row, length - len(answer) :] = True
    return tokens, mask, target


def greedy_completions(cfg: ModelConfig, params: dict, tokenizer, examples: list[Example], max_new: int) -> list[str]:
    """Each example's greedy completion (decoded, special tokens dropped), from the plain-template prompt."""
    prompts = [tokenizer.encode(PLAIN_TEMPLATE.format(question=e.prompt)) for e in examples]
    tokens, mask = pad_prompts(prompts, pad_id=tokenizer.pad_token_id)
    gen = generate(
        cfg,
        params,
        tokens,
        jax.random.key(0),
        max_new_tokens=max_new,
        temperature=0.0,
        prompt_mask=mask,
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
    )
    out, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
    return tokenizer.batch_decode([t[:n] for t, n in zip(out, lengths)], skip_special_tokens=True)


def completion_figures(examples: list[Example], texts: list[str], tokenizer) -> dict:
    """Greedy held-out accuracy by the task's scorer and mean tokens per completion; for worked solutions (lines
    before "#### n"), mean lines per completion and the fraction of completions holding a line that differs from the
    reference solution's at its position (or a missing or extra line), among right and among wrong final answers."""
    right = np.array([score(e, t) for e, t in zip(examples, texts)], bool)
    figures = {
        "greedy_accuracy": float(right.mean()),
        "mean_tokens": float(np.mean([len(tokenizer.encode(t)) for t in texts])),
    }
    if all("\n" in e.solution for e in examples):
        lines = [t.strip().split("\n")[:-1] for t in texts]  # the lines before the final "#### n"
        wrong = np.array([got != e.solution.split("\n")[:-1] for got, e in zip(lines, examples)])
        figures.update(
            mean_steps=float(np.mean([len(x) for x in lines])),
            wrong_step_given_right_answer=float(wrong[right].mean()) if right.any() else float("nan"),
            wrong_step_given_wrong_answer=float(wrong[~right].mean()) if (~right).any() else float("nan"),
        )
    return figures


def supervised_stats(cfg: ModelConfig, params: dict, tokens, mask, target) -> tuple[jax.Array, jax.Array]:
    """(mean NLL of the target tokens, the fraction of rows whose every target token is the argmax): position t
    predicts token t + 1, `target` marks the tokens that get loss."""
    logits, _ = forward(cfg, params, tokens, mask_BxT=mask)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nxt, tgt = tokens[:, 1:], target[:, 1:]
    nll = -jnp.take_along_axis(logp, nxt[..., None], -1)[..., 0]
    loss = (nll * tgt).sum() / tgt.sum()
    hit = (logits[:, :-1].argmax(-1) == nxt) | ~tgt
    return loss, hit.all(-1).mean()


def supervised_step(cfg: ModelConfig, opt: optax.GradientTransformation):
    """The jitted step(params, opt_state, tokens, mask, target) -> (params, opt_state, loss) on `supervised_stats`'s
    loss."""

    @jax.jit
    def step(params, opt_state, tokens, mask, target):
        (loss, _), grads = jax.value_and_grad(supervised_stats, argnums=1, has_aux=True)(
            cfg, params, tokens, mask, target
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", type=Path, default=Path("assets/tiny-qwen3-arith"), help="folder to write the model and tokenizer to")
    add("--seed", type=int, default=0, help="initialisation and batch-order seed")
    add("--batch", type=int, default=128, help="training sequences per step")
    add("--lr", type=float, default=1e-3, help="Adam learning rate")
    add("--max_steps", type=int, default=4000, help="stop after this many steps if --stop_at is not reached")
    add("--eval_every", type=int, default=10, help="steps between held-out exact-match evaluations")
    add("--stop_at", type=float, default=0.35, help="stop at the first evaluation with at least this exact match")
    add("--vocab", type=int, default=384, help="BPE vocabulary size of the tokenizer")
    add("--task", default="arithmetic", help="data.task of the default experiment's data section to train on")
    add("--tokenizer", type=Path, help="reuse the tokenizer saved in this model folder (a student's, for a teacher "
        "that must share it exactly) instead of building one; --vocab is then not read")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer: {args.tokenizer / 'tokenizer.json'} not found")

    cd = default_config()
    cd.data.task = args.task
    data_cfg = check_names(from_config_dict(cd.to_dict())).data
    train, held_out = make_splits(data_cfg)
    texts = [PLAIN_TEMPLATE.format(question=e.prompt) + e.target_text for e in train[:5000]]
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        for key in ("is_local", "local_files_only"):  # how it was loaded, not what it is: saved as the student's
            tokenizer.init_kwargs.pop(key, None)
    else:
        tokenizer = build_tokenizer(texts, args.vocab)
    cfg = model_config(len(tokenizer), tokenizer.eos_token_id)
    length = max(len(tokenizer.encode(t)) for t in texts) + 2
    train_arrays = encode_supervised(tokenizer, train, length)
    eval_arrays = [jnp.asarray(a) for a in encode_supervised(tokenizer, held_out, length)]

    start = time.perf_counter()
    params = init_params(cfg, jax.random.key(args.seed))
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 100, args.max_steps), weight_decay=0.01)
    opt_state = opt.init(params)

    stats = functools.partial(supervised_stats, cfg)
    step = supervised_step(cfg, opt)
    evaluate = jax.jit(stats)
    rng = np.random.default_rng(args.seed)
    history = []
    for i in range(1, args.max_steps + 1):
        idx = rng.integers(0, len(train), args.batch)
        params, opt_state, loss = step(params, opt_state, *(jnp.asarray(a[idx]) for a in train_arrays))
        if i % args.eval_every == 0:
            eval_loss, acc = (float(x) for x in evaluate(params, *eval_arrays))
            history.append({"step": i, "train_loss": float(loss), "eval_loss": eval_loss, "eval_exact_match": acc})
            print(
                f"step {i:5d}  train loss {float(loss):.3f}  eval loss {eval_loss:.3f}  eval exact match {acc:.3f}",
                flush=True,
            )
            if acc >= args.stop_at:
                break
    save_hf(args.out, cfg, params, tokenizer=tokenizer)
    max_new = max(len(tokenizer.encode(e.target_text)) for e in held_out) + 2
    figures = completion_figures(held_out, greedy_completions(cfg, params, tokenizer, held_out, max_new), tokenizer)
    summary = {
        "task": args.task,
        "command": "python -m experiments.pretrain_tiny " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.perf_counter() - start, 1),
        "seed": args.seed,
        "steps": history[-1]["step"],
        "eval_exact_match": history[-1]["eval_exact_match"],
        **figures,
        "n_train": len(train),
        "n_eval": len(held_out),
        "history": history,
    }
    (args.out / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"saved {args.out} ({sum(x.size for x in jax.tree.leaves(params))} parameters)")
    return summary


if __name__ == "__main__":
    main()
