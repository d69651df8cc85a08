"""Config keys as config files spell them (dotted, "es.sigma"), the sections of options that registered
implementations bring (`Options`), the keys renamed since (`RENAMED`, `migrate`) and the one-line error of an unknown
key (`unknown_key`, with the nearest known one)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any


def dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested dict, keys as a config file spells them ("es.sigma")."""
    out = {}
    for k, v in d.items():
        out.update(dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def nested(flat: dict[str, Any], sep: str = ".") -> dict:
    """The inverse of `dotted`: {"optimizer.lr": 1e-3} -> {"optimizer": {"lr": 1e-3}} (keys split at `sep`)."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(sep)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class Options(dict):
    """The options of registered implementations, by name: `grpo.adv` ({estimator: its options}),
    `grpo.variant_options`, `es.shaping_options`. An implementation registers its own frozen options dataclass beside
    its code (`esroll.registry.Registry.add(..., options=)`), so adding one with a hyperparameter edits no config
    module; this module, which cannot see the registries, keeps each section as the config file wrote it (a mapping
    of mappings), and `esroll.experiment.check_names` builds every registered name's dataclass from it (refusing
    unknown names and keys with the nearest one) and fills in the defaults of those not set.

    Immutable and hashable like the frozen dataclasses around it (compiled programs are cached per config)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in dict.items(self):
            dict.__setitem__(self, key, _frozen(value))

    def __hash__(self):  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return type(self), (dict(self),)

    def _immutable(self, *args, **kwargs):
        raise TypeError("config options are immutable: build a new Options (or use dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _immutable  # type: ignore


def _frozen(value: Any) -> Any:
    """A config file's value as an immutable one: mappings as `Options`, lists as tuples."""
    if isinstance(value, Options) or dataclasses.is_dataclass(value):
        return value
    if hasattr(value, "items"):  # a dict or an ml-collections ConfigDict
        return Options({k: v for k, v in value.items()})
    if isinstance(value, list):
        return tuple(value)
    return value


# Keys renamed when estimators and variants took their options beside their code: old dotted key -> new one. A
# config file or command line that sets an old key is refused with one line naming the new one; a run's saved
# config.json written with the old keys is read through `migrate`, so the run resumes.
RENAMED = {
    **{
        f"grpo.adv.{old}": f"grpo.adv.agrae.{new}"
        for old, new in (
            ("horizon", "horizon"),
            ("agrae_positive", "positive"),
            ("agrae_positive_final", "positive_final"),
            ("agrae_focus", "focus"),
        )
    },
    "grpo.adv.cluster_key": "grpo.adv.bv_blend.cluster_key",
    **{f"grpo.adv.bv_{k}": f"grpo.adv.bv_blend.{k}" for k in ("clusters", "decay", "blend_max", "sem", "prior_var")},
    "grpo.adv.gmae_context": "grpo.adv.gmae.context",
    "grpo.adv.gmae_max_contexts": "grpo.adv.gmae.max_contexts",
    "grpo.adv.maxpo_k": "grpo.adv.maxpo.k",
    "grpo.adv.lampo_temperature": "grpo.adv.lampo.temperature",
    **{f"grpo.adv.ntf_{k}": f"grpo.adv.ntf.{k}" for k in ("baseline", "decay", "normalize", "filter_prob")},
    **{f"grpo.adv.ddrl_{k}": f"grpo.adv.ddrl.{k}" for k in ("low", "high", "value")},
    **{
        f"grpo.stare.{k}": f"grpo.variant_options.stare.{k}"
        for k in ("quantile", "alpha", "entropy_low", "entropy_high")
    },
    **{f"grpo.acpo.{k}": f"grpo.variant_options.acpo.{k}" for k in ("edges", "scale", "min", "max")},
    "grpo.progress.coef": "grpo.variant_options.progress.coef",
}
_ADDED_SECTIONS = ("es.shaping_options", "grpo.variant_options")  # empty in a config.json that predates them


def migrate(config: dict) -> dict:
    """A saved config.json (nested dicts) with every `RENAMED` key moved to its new place and the sections added
    since present; a config without old keys comes back equal."""
    flat = dotted(config)
    if not any(k in RENAMED for k in flat):
        return config
    out = nested({RENAMED.get(key, key): value for key, value in flat.items()})
    for key in _ADDED_SECTIONS:
        section, name = key.split(".")
        out.setdefault(section, {}).setdefault(name, {})
    return out


def unknown_key(key: str, known: Iterable[str]) -> str:
    """'unknown key 'es.sigmaa' (did you mean 'es.sigma'?)' — the nearest known key of the same section; for a key
    that was renamed, its new name."""
    if key in RENAMED:
        return f"config: key '{key}' is now '{RENAMED[key]}'"
    if any(k.startswith(key + ".") for k in RENAMED):
        renamed = sorted({RENAMED[k].rsplit(".", 1)[0] for k in RENAMED if k.startswith(key + ".")})
        return f"config: section '{key}' is now {', '.join(map(repr, renamed))}"
    known = sorted(known)
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else f"known: {', '.join(known)}"
    return f"config: unknown key '{key}' ({hint})"
