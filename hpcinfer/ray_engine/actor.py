"""The Ray Data actor: one replica per actor, fed one unit per call by `map_batches`.

Units and results cross Ray as pickled bytes in a binary column: Ray Data moves them through its
object store and never looks inside, so nothing of hpcinfer's types has to become Arrow.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from ..config import RunConfig
from ..tasks import replica_class


class ReplicaActor:
    """Ray Data callable class: loads the model once (in `__init__`), then runs the units it receives.

    `task` names the replica (`tasks.replica_class`): "embed" or "generate".

    `workdir` is the driver's working directory: relative input and model paths mean what they
    meant to the driver (on a cluster, inputs and model sit on a filesystem every node mounts).
    """

    def __init__(self, config: RunConfig, workdir: str, threads: int | None, task: str = "embed") -> None:
        if os.path.isdir(workdir):
            os.chdir(workdir)
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.replica: Any = replica_class(task)(config)  # NOTE: the task's modules, only where they run
        self.calls = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        results = []
        for blob in batch["unit"]:
            self.calls += 1
            results.append(pickle.dumps(self.replica.run(pickle.loads(blob)), protocol=pickle.HIGHEST_PROTOCOL))
        return {"result": np.array(results, dtype=object)}
