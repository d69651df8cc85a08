"""What every absl entry script does first: one CPU device per core, quiet orbax logs, no stray arguments."""

from __future__ import annotations

from absl import app, logging

from esroll import parallel


def start(argv) -> None:
    """Call first in `main(argv)`, before anything touches a JAX device."""
    parallel.use_cpu_cores_as_devices()
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
