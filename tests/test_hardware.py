"""The device kinds' figures and where each comes from, checks that catch a figure copied wrong,
and a cluster's refusals of input that names no real cluster."""

import pytest

from measure import hardware
from measure.hardware import FIGURES, KINDS


def test_every_figure_of_every_kind_says_where_it_comes_from():
  missing = [f"{kind.name}.{figure}" for kind in KINDS.values() for figure in FIGURES
             if not kind.sources.get(figure, "").strip()]
  assert not missing, "figures without a source: " + ", ".join(missing)
  stray = [f"{kind.name}.{key}" for kind in KINDS.values() for key in kind.sources if key not in FIGURES]
  assert not stray, "sources for no figure (a misspelt field?): " + ", ".join(stray)


def test_the_kinds_asked_for_are_there_under_their_own_names():
  assert {"a100", "h100", "h200", "b200", "tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e"} <= set(KINDS)
  assert all(name == kind.name for name, kind in KINDS.items())


def test_figures_are_positive_and_in_the_order_the_hardware_has_them():
  # A figure typed in the wrong unit (Gb for GB, bidirectional for one way) breaks one of these.
  for kind in KINDS.values():
    assert kind.bf16_flops > 0 and kind.hbm_bytes > 0 and kind.fast_group >= 1, kind.name
    assert kind.hbm_bandwidth > kind.fast_link_bandwidth > kind.slow_link_bandwidth > 0, kind.name
    assert 10e9 < kind.hbm_bytes < 300e9, kind.name


@pytest.mark.parametrize("name", ["h100", "h200", "b200"])
def test_nvidia_states_fp8_at_twice_bf16(name):
  kind = KINDS[name]
  assert kind.fp8_flops == 2 * kind.bf16_flops


def test_a_cluster_takes_its_groups_and_slow_link_from_the_kind_unless_told():
  h100 = hardware.cluster("h100", 64)
  assert (h100.groups, h100.fast_group, h100.slow_link_bandwidth) == (8, 8, 50e9)
  slices = hardware.cluster("tpu_v5p", 8192, fast_group=2048, slow_link_bandwidth=12.5e9)
  assert (slices.groups, slices.slow_link_bandwidth, slices.kind.name) == (4, 12.5e9, "tpu_v5p")


def test_a_cluster_smaller_than_a_group_is_one_group_of_its_devices():
  four = hardware.cluster("h100", 4)
  assert (four.fast_group, four.groups) == (4, 1)
  assert hardware.cluster("tpu_v5e", 16, fast_group=256).groups == 1


@pytest.mark.parametrize("args, message", [
    (("h900", 8), r"^unknown device kind 'h900'; give one of a100, h100, "),
    (("h100", 0), r"^devices=0 is not a positive count; give 1 or more\."),
    (("h100", 12), r"^fast_group=8 does not divide devices=12; give whole groups \(a multiple of 8 devices\)"),
    (("h100", 16, 0), r"^fast_group=0 is not a positive count; give the devices per node or slice, e\.g\. 8"),
    (("h100", 16, 8, 0.0), r"^slow_link_bandwidth=0.0 is not positive; give bytes/s per device across groups"),
])
def test_a_cluster_refuses_what_names_no_real_cluster_in_a_sentence(args, message):
  with pytest.raises(ValueError, match=message):
    hardware.cluster(*args)
