"""Fitness shaping: what `es.shaping` (before the estimator, inside the jitted update) and `es.prompt_shaping`
(across the members, prompt by prompt, on the host) name.

A shaping maps fitness [X groups, M members] (or [M]) to the same shape, `fn(rewards, valid=None)`; the built-ins are
the group-relative transforms of `esroll.baselines` (raw keeps the estimators unbiased; zscore makes the update
independent of the reward scale; centered_ranks is OpenAI-ES's and evosax's rank transform). The registry is open:
`register_shaping(name, fn)` adds one, through the same path the built-ins take (docs/extending.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from esroll import baselines
from esroll.baselines import Shaping
from esroll.registry import Registry

Array = jax.Array

# name -> the lifted shaping (with options: fn(rewards, valid=None, *, options))
SHAPINGS: Registry[Shaping] = Registry("fitness shaping", "es.shaping", options_key="es.shaping_options")


def register_shaping(
    name: str, fn: Callable[..., Array] | None = None, *, options: type | None = None, replace: bool = False
):
    """Register the fitness shaping `es.shaping = name` / `es.prompt_shaping = name` selects.

    fn(r_XxM, valid_XxM) -> [X, M]: rewards as float32 [X groups, M members] whose invalid entries (masked out, or
    non-finite) are already 0, and the bool mask of the valid ones; compute each group's statistics over its valid
    entries only. It is registered lifted to the public signature (`esroll.baselines.lift`: 1-D input, default mask,
    invalid entries of the result set to 0), which is what `get(name)` returns, and what this function returns.
    Write it with jax.numpy: `es.shaping` is applied inside the jitted ES update, `es.prompt_shaping` on host arrays.

    options: the shaping's own frozen options dataclass (keys `es.shaping_options.<name>.<field>`); fn then takes
    them as a third argument, fn(r_XxM, valid_XxM, options), and `get(name, options)` binds them.

    A name already registered is refused unless `replace` is set. Without `fn`, a decorator that registers what it
    decorates and returns it lifted."""
    if fn is None:
        return lambda f: register_shaping(name, f, options=options, replace=replace)
    SHAPINGS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"{name!r}: {fn!r} is not callable")
    lifted = baselines.lift(fn) if options is None else _with_options(fn)
    return SHAPINGS.add(name, lifted, options=options, replace=replace)


def _with_options(fn: Callable[..., Array]) -> Shaping:
    def shaped(rewards, valid=None, *, options):
        bound = baselines.lift(lambda r, v: fn(r, v, options))
        return bound(rewards, valid)

    shaped.__name__, shaped.__doc__ = getattr(fn, "__name__", "shaping"), fn.__doc__
    return shaped


def get(name: str, options_section: Mapping[str, Any] | None = None) -> Shaping:
    """The shaping called `name`, fn(rewards, valid=None); one that takes options gets its own from
    `options_section` (an `es.shaping_options` section; None or absent: its defaults)."""
    shaped = SHAPINGS.lookup(name)
    if SHAPINGS.options.get(name) is None:
        return shaped
    return functools.partial(shaped, options=SHAPINGS.options_of(options_section or {}, name))


for _name, _shaping in baselines.BUILTIN.items():
    SHAPINGS.add(_name, _shaping)
