"""GSM8K (and Countdown) with Qwen3 0.6B / 1.7B / 4B / 8B: the experiments of the LOO-ROLL paper, scaled to real models.

    python -m experiments.train --config configs/gsm8k_qwen3.py:0.6b,looroll --workdir runs/gsm8k_0.6b_looroll \
        --config.model.path=/path/to/Qwen3-0.6B --config.data.path=/path/to/gsm8k/train.jsonl \
        --config.data.eval_path=/path/to/gsm8k/test.jsonl

The argument is SIZE[,METHOD][,countdown][,cpu]: SIZE in 0.6b, 1.7b, 4b, 8b; METHOD in looroll (default), eggroll,
grpo; `countdown` trains on generated Countdown problems (an arithmetic expression of the given numbers that reaches
the target, scored by rule) instead of GSM8K. `model.path` may be a local folder or a Hub id (Qwen/Qwen3-0.6B) when the machine has network access; `data.path`
a local JSONL/Parquet file or the `datasets` name "openai/gsm8k" (the `tasks` extra brings `datasets`). Held-out
evaluation is greedy on the whole GSM8K test split (1,319 questions) and logs the reward (`eval_accuracy`) beside the
harnesses' strict (`#### n`) and flexible (last number) matches (`eval_strict`, `eval_flexible`).

The `cpu` part keeps the model's shapes but shrinks the step (population 4 or 2 completions per prompt, 2 prompts,
16 new tokens, 2 steps, 8 held-out questions) and defaults to GSM-Symbolic problems generated offline, so that the
real-shape pipeline runs end to end on a CPU with no download, against a local folder such as the one
`python -m experiments.make_random_model --like qwen3-0.6b --out DIR` writes:

    python -m experiments.train --config configs/gsm8k_qwen3.py:0.6b,looroll,cpu --workdir runs/q06_cpu \
        --config.model.path=DIR --config.data.task=gsm_symbolic

Hardware, as `python -m experiments.plan --config configs/gsm8k_qwen3.py:SIZE --topology T --prompt_len 256` plans
ES (peak per device from the compiled step, prompt 256 + 512 new tokens; docs/scaling.md): 0.6B on a v5e:2x2 (13.3
of 16 GiB) or a v5p:2x2x1 (48.9 of 95 GiB); 1.7B on a v5e:2x2 (13.2 GiB) or a v5e:2x4 (11.1 GiB); 4B on a v5e:4x4
(model axis 4, 13.3 GiB); 8B on a v5e:8x8 (model axis 8, 14.6 GiB) or a v5p:2x2x2 (85.4 of 95 GiB). GRPO (same
model axis) fits there too: 0.6B and 1.7B on a v5e:2x2 (13.6 and 14.5 GiB), 4B on a v5e:4x4 (8.5 GiB), 8B on a
v5e:8x8 (5.2 GiB). GPUs are not planned; plan on the GPU host with `--topology local`. Multi-host:
`--config.distributed=True`, one process per host, a shared or gs:// workdir. None of these configs has run on an
accelerator.
Reference (the LOO-ROLL paper, docs/theory.md): LOO-ROLL on GSM8K test 38.1% -> 63.0% (0.6B), 65.9% -> 80.0% (8B).
"""

from ml_collections import ConfigDict

from configs.default import get_config as default_config

VARIANTS = {
    "SIZE[,METHOD][,countdown][,cpu]": "SIZE in 0.6b, 1.7b, 4b, 8b; METHOD in looroll (default), eggroll, grpo; "
    "countdown: generated Countdown problems (reach a target with the given numbers) in place of GSM8K; "
    "cpu: the real shapes with a tiny step, on GSM-Symbolic (or Countdown)",
}
PARTS = ("looroll", "eggroll", "grpo", "countdown", "cpu")
SIZES = {
    # size: (ES population, prompts per step, sigma, GRPO microbatches, model axis)
    "0.6b": (256, 64, 1e-3, 2, 1),
    "1.7b": (256, 64, 1e-3, 4, 1),
    "4b": (128, 64, 7e-4, 8, 4),
    "8b": (128, 64, 5e-4, 16, 8),
}


def get_config(arg: str | None = None) -> ConfigDict:
    parts = [p for p in (arg or "0.6b").split(",") if p]
    size, rest = parts[0], parts[1:]
    if size not in SIZES:
        raise ValueError(f"configs/gsm8k_qwen3.py: unknown size {size!r} (expected one of {', '.join(SIZES)})")
    method = next((p for p in rest if p in ("looroll", "eggroll", "grpo")), "looroll")
    countdown = "countdown" in rest
    cpu = "cpu" in rest
    unknown = [p for p in rest if p not in PARTS]
    if unknown:
        raise ValueError(f"configs/gsm8k_qwen3.py: unknown variant part {unknown[0]!r}")
    population, prompts, sigma, microbatches, model_axis = SIZES[size]

    c = default_config()
    c.method = method
    c.model.path = f"Qwen/Qwen3-{size.upper()}"
    c.model.dtype = "bfloat16"
    c.data.task = "countdown" if countdown else "gsm8k"
    c.data.path = "" if countdown else "openai/gsm8k"
    c.data.eval_path = "" if countdown else "openai/gsm8k"
    c.data.n_examples = 20000
    c.data.eval_size = 500 if countdown else 1319  # GSM8K: the whole test split
    c.data.template = "chat"
    c.data.system = (
        "Solve the problem step by step, then give the final answer after '####'."
        if not countdown
        else "Write an arithmetic expression that reaches the target, inside <answer></answer>."
    )
    c.es.population = population
    c.es.rank = 1
    c.es.sigma = sigma
    c.es.shaping = "zscore"
    c.parallel.model = model_axis  # tensor parallelism: decoding (ES, GRPO) and GRPO's update
    c.optimizer.name = "adam"
    c.optimizer.lr = 5e-4
    c.train.steps = 500
    c.train.prompts_per_step = prompts
    c.train.max_new_tokens = 512
    c.train.eval_every = 25
    c.train.checkpoint_every = 25
    if method == "grpo":
        c.grpo.group_size = 8
        c.grpo.microbatches = microbatches
        c.grpo.remat = "full"
        c.grpo.beta = 0.0
        c.optimizer.name = "adamw"
        c.optimizer.lr = 1e-6
        c.optimizer.weight_decay = 0.0
        c.optimizer.max_grad_norm = 1.0
        c.train.prompts_per_step = 32
    if cpu:
        c.model.path = ""  # a local folder: --config.model.path=DIR
        c.data.task = "countdown" if countdown else "gsm_symbolic"
        c.data.path = c.data.eval_path = ""
        c.data.n_examples = 200
        c.data.eval_size = 8
        c.es.population = 4
        c.parallel.model = 1
        c.grpo.group_size = 2
        c.grpo.microbatches = 1
        c.train.prompts_per_step = 2
        c.train.max_new_tokens = 16
        c.train.steps = 2
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
    return c
