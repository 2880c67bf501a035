"""One of two processes standing for two slices (or GPU hosts), started by tests/test_tiers.py: 4 CPU
devices each, data=4 x tensor=2 with mesh.dcn_data=2. Compiles the train step and prints one JSON line
(process 0): each device's process on the mesh beside the slow-tier group its coordinates give, and
each collective's kind, axes and the processes one of its replica groups spans."""

import json
import sys

import jax
import numpy as np

from helpers import tiny_config
from measure import analysis
from measure.dry_run import compile_partitioned_train_step
from parallel.mesh import slow_tier_groups, slow_tier_shape
from training.state import plan

LAYOUT = {"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2}


def main(coordinator: str, process_id: int) -> None:
  jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
  config = tiny_config(**LAYOUT)
  layout = plan(config)
  slow = slow_tier_shape(config.mesh, dict(layout.mesh.shape))
  compiled, partitioned = compile_partitioned_train_step(layout, config)
  found = analysis.collectives(compiled, layout.mesh, partitioned, slow=slow)
  if process_id == 0:
    print(json.dumps({
        "processes": np.vectorize(lambda d: d.process_index)(layout.mesh.devices).tolist(),
        "slow_tier_groups": slow_tier_groups(layout.mesh, slow).tolist(),
        "collectives": sorted({(c.kind, "+".join(c.axes), c.slow_groups) for c in found}),
        "by_tier": {f"{kind} over {axes}": t for (kind, axes), t in analysis.tier_traffic_per_step(found).items()},
    }))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
