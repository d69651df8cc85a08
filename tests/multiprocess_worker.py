"""One process of the two-process test: runs two quick ES steps on a (data 2 × model 2) mesh and saves its final
parameters."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.experimental.multihost_utils
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from conftest import quick_config  # noqa: E402
from esroll.parallel import maybe_initialize_distributed  # noqa: E402
from esroll.train import train_and_evaluate  # noqa: E402

if __name__ == "__main__":
    maybe_initialize_distributed(True)
    workdir, out = sys.argv[1], sys.argv[2]
    cfg = quick_config("quick", steps=2, eval_every=100, checkpoint_every=100, export=True)  # a model split over hosts
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, model=2))
    result = train_and_evaluate(cfg, workdir, progress=False)
    params = jax.experimental.multihost_utils.process_allgather(result["params"], tiled=True)
    np.savez(out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)})
