"""Evolution strategies with low-rank noise: antithetic EGGROLL and LOO-ROLL (see /THEORY.md).

`strategy` is the entry point (ESConfig, init / ask / tell); `noise` draws the factors, `estimators` turns fitness
into an update, `theory` holds the variance predictions and Monte-Carlo helpers used by tests and notebooks.
"""

from esroll.es.strategy import ESConfig, ESState, ask, estimate, init, member_deltas, step_factors, tell

__all__ = ["ESConfig", "ESState", "ask", "estimate", "init", "member_deltas", "step_factors", "tell"]
