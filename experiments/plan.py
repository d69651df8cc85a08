"""Will a config's training step fit the target's devices? Compile it for them — without them, for a TPU topology —
and print the memory each device needs.

    python -m experiments.plan --config configs/gsm8k_qwen3.py:8b,looroll --topology v5e:8x8 [--json PATH]
        [--config.parallel.model=8] [--prompt_len 256]

--topology names a TPU slice ("v5e:2x2", "v5e:4x4", "v5e:8x8", "v5p:2x2x2", ...): the step is compiled by JAX's
deviceless ahead-of-time compilation on the host running it, which needs libtpu (`pip install -e '.[plan]'`), not a TPU.
--topology=local compiles for the local devices instead. Model shapes come from `model.path` when it is a
local folder with a config.json, else from the built-in presets of the published configs (`esroll.models.presets`:
"Qwen/Qwen3-8B" is the preset qwen3-8b); nothing is downloaded. An ES step (`esroll.es.plan`) is the cast of the master
weights to the decoding copy, ask, one chunk of generate, tell, and held-out evaluation's generate; a GRPO step the
cast, one chunk of sampling, the optimizer update of one minibatch, and evaluation. The printed peak adds the buffers
that live beside each program. Exit status 0 when it fits, 3 when it does not. --choose_remat (a policy-gradient step)
also compiles the update under each remat policy (none, dots, full: cheapest first) and names the cheapest that
fits, with each one's temporaries per layer.
"""

import dataclasses
import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from esroll.config import from_config_dict
from esroll.errors import InputError
from esroll.experiment import check_names
from experiments._entry import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py[:variant]).")
_TOPOLOGY = flags.DEFINE_string("topology", "local", "A TPU topology such as v5e:8x8, or 'local' (the local devices).")
_JSON = flags.DEFINE_string("json", None, "Also write the plan as JSON to this path.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Padded prompt length in tokens (the data's prompt bucket).")
_CHOOSE_REMAT = flags.DEFINE_bool(
    "choose_remat",
    False,
    "A policy-gradient step: compile the update under every remat policy and name the cheapest that fits (grpo.remat).",
)
flags.mark_flags_as_required(["config"])

GiB = 1024**3


def size(n: int) -> str:
    """Bytes as GiB ("13.27G") from 1 GiB up, else as MiB ("3.2M")."""
    return f"{n / GiB:.2f}G" if n >= GiB else f"{n / 2**20:.1f}M"


def model_shapes(path: str):
    """The ModelConfig of `model.path`: a local folder's config.json, or the preset its name matches."""
    from esroll.models import PRESETS, ModelConfig, model_config

    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelConfig.from_json_file(os.path.join(path, "config.json")), os.path.join(path, "config.json")
    name = os.path.basename(path.rstrip("/")).lower()
    if name in PRESETS:
        return model_config(name), f"preset {name}"
    raise InputError(
        f"config: 'model.path' = {path!r}: no local config.json and no preset of that name "
        f"(presets: {', '.join(PRESETS)})"
    )


def main(argv):
    import jax

    from esroll import parallel
    from esroll.methods import plan_step
    from esroll.models import attention
    from esroll.plan import topology_mesh

    cfg = check_names(from_config_dict(_CONFIG.value.to_dict()))
    model_cfg, source = model_shapes(cfg.model.path)
    if _TOPOLOGY.value == "local":
        mesh, platform = parallel.make_mesh(model=cfg.parallel.model), jax.default_backend()
    else:
        try:
            mesh, platform = topology_mesh(_TOPOLOGY.value, cfg.parallel.model)
        except ValueError as e:
            raise InputError(str(e)) from None
    model_cfg = dataclasses.replace(model_cfg, attention=attention.choose(cfg.model.attention, mesh))
    choose = {}
    if _CHOOSE_REMAT.value:
        if cfg.method != "grpo":
            raise InputError(f"--choose_remat: method {cfg.method!r} has no backward pass to rematerialise")
        choose = {"choose_remat": True}
    p = plan_step(cfg, model_cfg, mesh, platform=platform, prompt_len=_PROMPT_LEN.value, **choose)
    spec = flags.FLAGS["config"].config_filename
    limit = p.device_memory_bytes
    shape = " × ".join(f"{k} {v}" for k, v in p.mesh_shape.items())
    lines = [
        f"plan of {spec} ({source}) on {_TOPOLOGY.value}: {mesh.size} × {p.device_kind}"
        + (f", {limit / GiB:.1f} GiB each" if limit else "")
        + f"; mesh {shape}; compiled for {platform}",
        f"rows: {p.rows_per_step} per step in {p.chunks} chunk(s) of {p.rows_per_device} per device; evaluation "
        f"{p.eval_rows_per_device or 'all'} per device; prompt {p.prompt_len} + {p.new_tokens} new tokens",
        "resident per device: " + ", ".join(f"{k} {size(v)}" for k, v in p.resident.items()),
        f"{'program':<10}{'arguments':>11}{'outputs':>10}{'aliased':>10}{'temps':>10}{'+resident':>11}"
        f"{'= peak':>10}{'compile':>9}",
    ]
    for q in p.programs:
        sizes = (q.argument_bytes, q.output_bytes, q.alias_bytes, q.temp_bytes, q.other_resident_bytes, q.peak_bytes)
        widths = (11, 10, 10, 10, 11, 10)
        lines.append(
            f"{q.name:<10}" + "".join(f"{size(b):>{w}}" for b, w in zip(sizes, widths)) + f"{q.compile_s:>8.1f}s"
        )
    verdict = "unknown (device memory not reported)" if p.fits is None else ("fits" if p.fits else "does NOT fit")
    lines.append(
        f"peak {size(p.peak_bytes_per_device)} per device"
        + (f" of {limit / GiB:.1f} GiB" if limit else "")
        + f" ({p.peak_program.name}): {verdict}"
    )
    if p.remat:
        lines.append(f"remat (grpo.remat = {cfg.grpo.remat!r}): the update under each policy, cheapest first")
        for name, o in p.remat.items():
            verdict = {None: "", True: "fits", False: "does NOT fit"}[o["fits"]]
            lines.append(
                f"  {name:<6} temps {size(o['temp_bytes'])} ({size(o['temp_bytes_per_layer'] or 0)} per layer), "
                f"peak {size(o['peak_bytes'])} {verdict}"
            )
        lines.append(f"  chosen: {p.remat_choice or 'none fits'}")
    print("\n".join(lines), flush=True)
    if _JSON.value:
        record = {"config": spec, "topology": _TOPOLOGY.value, "model": source, **p.to_json()}
        os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
        with open(_JSON.value, "w") as f:
            json.dump(record, f, indent=2)
    if p.fits is False:
        sys.exit(3)


def _deviceless() -> bool:
    """A TPU topology is compiled for on the local CPU backend: keep JAX off any local accelerator."""
    return "--topology=local" not in sys.argv and any(a.startswith("--topology") for a in sys.argv)


if __name__ == "__main__":
    if _deviceless():
        import jax

        jax.config.update("jax_platforms", "cpu")
    run(main)
