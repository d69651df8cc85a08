"""Build the small model that ships with esroll: a Qwen3-architecture decoder and tokenizer trained with plain
supervised learning on synthetic 2-digit addition, stopped mid-way so ES and GRPO have clear headroom.

    python -m experiments.pretrain_tiny --out assets/tiny-qwen3-arith

Deterministic from --seed. Training stops at the first evaluation whose held-out exact match reaches --stop_at
(default 0.35) or after --max_steps. The held-out questions are the same ones the default experiment evaluates on
(`esroll.data.make_splits` with the default config), so they are never trained on. Exact match is measured with
teacher forcing: every answer token (and the EOS) is the argmax, which is the same event as greedy decoding
producing the answer exactly.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from esroll.config import from_config_dict
from esroll.data import PLAIN_TEMPLATE, Example, make_splits
from esroll.models import ModelConfig, forward, param_shapes, save_hf

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


def main(argv=None) -> dict:
    from configs.default import get_config

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
    args = parser.parse_args(argv)

    data_cfg = from_config_dict(get_config()).data
    train, held_out = make_splits(data_cfg)
    texts = [PLAIN_TEMPLATE.format(question=e.prompt) + e.target_text for e in train[:5000]]
    tokenizer = build_tokenizer(texts, args.vocab)
    cfg = model_config(len(tokenizer), tokenizer.eos_token_id)
    length = max(len(tokenizer.encode(t)) for t in texts) + 2
    train_arrays = encode_supervised(tokenizer, train, length)
    eval_arrays = [jnp.asarray(a) for a in encode_supervised(tokenizer, held_out, length)]

    params = init_params(cfg, jax.random.key(args.seed))
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 100, args.max_steps), weight_decay=0.01)
    opt_state = opt.init(params)

    def stats(params, tokens, mask, target):
        logits, _ = forward(cfg, params, tokens, mask_BxT=mask)
        # Position t predicts token t+1.
        logp = jax.nn.log_softmax(logits[:, :-1])
        nxt, tgt = tokens[:, 1:], target[:, 1:]
        nll = -jnp.take_along_axis(logp, nxt[..., None], -1)[..., 0]
        loss = (nll * tgt).sum() / tgt.sum()
        hit = (logits[:, :-1].argmax(-1) == nxt) | ~tgt
        return loss, hit.all(-1).mean()

    @jax.jit
    def step(params, opt_state, tokens, mask, target):
        (loss, _), grads = jax.value_and_grad(stats, has_aux=True)(params, tokens, mask, target)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

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
    summary = {
        "seed": args.seed,
        "steps": history[-1]["step"],
        "eval_exact_match": history[-1]["eval_exact_match"],
        "n_train": len(train),
        "n_eval": len(held_out),
        "history": history,
    }
    (args.out / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"saved {args.out} ({sum(x.size for x in jax.tree.leaves(params))} parameters)")
    return summary


if __name__ == "__main__":
    main()
