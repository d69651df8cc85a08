"""esroll: evolution strategies (EGGROLL, LOO-ROLL) and a GRPO baseline for LLM post-training in JAX.

Kept import-light on purpose: `import esroll.rewards` must not pull in JAX.
"""
