"""The longest sequence whose per-device bytes, by measure/estimate.py, fit a device's memory, with every
device on the `sequence` axis (tools/longest_context.py tabulates it, tools/longest_offload.py compiles it)."""

import dataclasses

from measure import estimate
from measure.sizes import run_of

STEP = 1024  # lengths searched in multiples of this (times the device count)


def sequence_mesh(devices: int) -> dict:
  return {"data": 1, "pipeline": 1, "expert": 1, "sequence": devices, "tensor": 1}


def fits(config, length: int, devices: int, memory_bytes: int, weights) -> bool:
  run = run_of(config)  # a Run of the config at `length`, the config left as it was
  run = dataclasses.replace(run, model=dataclasses.replace(run.model, max_len=length))
  return sum(estimate.memory(run, sequence_mesh(devices), weights).values()) <= memory_bytes


def longest(config, devices: int, memory_bytes: int, weights) -> int:
  """The longest multiple of STEP x devices that fits (0 if none): memory grows with length, so bisect."""
  unit = STEP * devices
  low, high = 0, 1
  while fits(config, high * unit, devices, memory_bytes, weights):
    low, high = high, high * 2
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(config, middle * unit, devices, memory_bytes, weights) else (low, middle)
  return low * unit
