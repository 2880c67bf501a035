"""What a train step should cost per device, by arithmetic, nothing compiled or allocated: the estimator's
public names, each from the module of its concern.

- measure/sizes.py: the run as one frozen record (Run), the per-device sizes a step works on, how often its
  layers run;
- measure/activations.py: what the backward pass keeps, on the device and in host memory;
- measure/memory.py: params, gradients, optimizer state, batch and activations per device;
- measure/collectives.py: the bytes each device sends per step, by kind and axes and by what sends them;
- measure/flops.py: the matmul FLOPs of the busiest device, and the textbook's ideal.

Each strategy's and optimizer's own costs live beside its code (parallel/context.py, parallel/schedules.py,
parallel/experts.py, training/optimizer.py, training/muon.py), in parallel/costs.py's terms; these modules
compose them. The arithmetic is the textbook's (MLSysBook ch. 18, the distributed-training chapter).
"""

from measure.activations import host_memory, saved_per_layer
from measure.collectives import collectives, collectives_by_source
from measure.flops import flops, ideal_flops, optimizer_flops, stage_forward
from measure.memory import memory
from measure.sizes import dims, layer_passes, stage_elements, stage_layers

__all__ = ["collectives", "collectives_by_source", "dims", "flops", "host_memory", "ideal_flops", "layer_passes",
           "memory", "optimizer_flops", "saved_per_layer", "stage_elements", "stage_forward", "stage_layers"]
