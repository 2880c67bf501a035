"""The device kinds a run can be sized for, with their published figures, and a cluster of them.

Each figure carries where it comes from (`DeviceKind.sources`), since vendors state them in
different units and directions: NVIDIA quotes NVLink both ways added up and peak FLOP/s with 2:4
sparsity, Google quotes ICI per chip or per pod. Here every figure is in bytes or FLOP/s, dense,
one direction; where a figure is a convention or a division rather than a datasheet number, its
source says the arithmetic.
"""

import dataclasses

GIB = 2**30
GBIT = 1e9 / 8  # bytes/s in 1 Gb/s

# The documents the figures come from, named once so each source line can say what it took.
A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
                  "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (read as transcribed "
                  "at https://glennklockwood.com/garden/processors/A100, which cites it)")
H100_PAGE = ("NVIDIA H100 product page, https://www.nvidia.com/en-us/data-center/h100/ (not itself in the "
             "searchable copies; its figures as given at https://glennklockwood.com/garden/processors/h100)")
H200_PAGE = ("NVIDIA H200 product page, https://www.nvidia.com/en-us/data-center/h200/ (not itself in the "
             "searchable copies; its figures as given at https://ai-hpc.github.io/ai-hardware-engineer-roadmap/"
             "Phase%205%20-%20Advanced%20Topics%20and%20Specialization/1.%20GPU%20Infrastructure/Nvidia%20GPU/"
             "HPC%20Setup/8x-H200-Training-Inference, and in MLCommons inference v4.1's system description "
             "https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/NVIDIA/systems/"
             "H200-SXM-141GBx8_TRT_MaxQ.json: '141 GB', '18x 4th Gen NVLink, 900GB/s')")
HGX_PAGE = ("NVIDIA HGX platform page, HGX B200 column, https://www.nvidia.com/en-us/data-center/hgx/ (its "
            "table as reproduced at https://zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html; "
            "the same figures at https://glennklockwood.com/garden/processors/B200)")
DGX_B200_GUIDE = ("NVIDIA DGX B200 User Guide, 'Introduction to NVIDIA DGX B200 Systems', "
                  "https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html")
HGX_FACTORY_RA = ("NVIDIA HGX AI Factory (H100, H200, B200) reference architecture, Abstract, "
                  "https://docs.nvidia.com/reference-architectures/hgx-ai-factory-h100-h200-b200/abstract.md")
MEGATRON = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM', arXiv 2104.04473, section 5 (the Selene cluster)")
BOOK_GPUS = ("How to Scale Your Model (Austin et al., 2025), 'How to Think About GPUs', "
             "https://jax-ml.github.io/scaling-book/gpus")
BOOK_TPUS = ("How to Scale Your Model (Austin et al., 2025), 'How to Think About TPUs', "
             "https://jax-ml.github.io/scaling-book/tpus")
# MLPerf system descriptions: each names its node's host memory ("host_memory_capacity") beside its 8 GPUs.
MLPERF_A100 = ("MLCommons training v1.0, Inspur NF5488A5 (8 x A100-SXM4-80GB), https://raw.githubusercontent.com/"
               "mlcommons/training_results_v1.0/master/Inspur/systems/nf5488a5_pytorch.json")
MLPERF_H100 = ("MLCommons inference v3.1, Dell XE9680 (8 x H100-SXM-80GB), https://github.com/mlcommons/"
               "inference_results_v3.1/blob/main/closed/Dell/systems/XE9680_H100_SXM_80GBx8_TRT.json")
MLPERF_H200 = ("MLCommons inference v4.1, NVIDIA H200-SXM-141GBx8, https://raw.githubusercontent.com/mlcommons/"
               "inference_results_v4.1/main/closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json")
MLPERF_B200 = ("MLCommons inference v6.0, Nebius B200 (8 x B200-SXM-180GB), https://raw.githubusercontent.com/"
               "mlcommons/inference_results_v6.0/main/closed/Nebius/systems/nebius_b200_n1.json")
# TPUs park nothing in host memory in the planner: step_time has no figure for their host link.
NO_TPU_OFFLOAD = "none: the planner does not offload on TPUs (measure/step_time.py HOST_LINK has no TPU)"
TPU_V4_DOCS = "Google Cloud TPU docs, 'TPU v4', https://cloud.google.com/tpu/docs/v4"
TPU_V5E_DOCS = "Google Cloud TPU docs, 'TPU v5e', https://cloud.google.com/tpu/docs/v5e"
TPU_V5P_DOCS = "Google Cloud TPU docs, 'TPU v5p', https://cloud.google.com/tpu/docs/v5p"
TPU_V6E_DOCS = "Google Cloud TPU docs, 'TPU v6e' (v5e beside v6e), https://cloud.google.com/tpu/docs/v6e"


@dataclasses.dataclass(frozen=True)
class DeviceKind:
  name: str  # the --kind flag value, e.g. "h100"
  description: str  # e.g. "NVIDIA H100 SXM5 80 GB"
  bf16_flops: float  # dense peak FLOP/s in bf16 (no sparsity)
  fp8_flops: float | None  # dense peak FLOP/s in fp8; None where the chip has no fp8 matmul
  hbm_bytes: float  # memory per device in bytes
  hbm_bandwidth: float  # bytes/s
  fast_link_bandwidth: float  # bytes/s per device, one direction, on the fast tier (NVLink; ICI within a slice)
  slow_link_bandwidth: float  # bytes/s per device, one direction, across fast groups (IB/RoCE NICs; DCN)
  fast_group: int  # devices per fast-tier group in the usual system (an HGX/DGX node; the largest TPU slice)
  host_bytes: float | None  # host memory per device in a usual node, where offloading remat policies park
  # values; None where the planner does not offload
  sources: dict[str, str]  # field name -> where the figure comes from, with the figure as stated there


# The fields that are figures: each kind's `sources` names every one of them.
FIGURES = tuple(field.name for field in dataclasses.fields(DeviceKind)
                if field.name not in ("name", "description", "sources"))


def _a100() -> DeviceKind:
  return DeviceKind(
      name="a100", description="NVIDIA A100 SXM4 80 GB",
      bf16_flops=312e12, fp8_flops=None, hbm_bytes=80e9, hbm_bandwidth=2039e9,
      fast_link_bandwidth=300e9, slow_link_bandwidth=25e9, fast_group=8, host_bytes=1e12 / 8,
      sources={
          "bf16_flops": f"{A100_DATASHEET}: BF16 Tensor Core 312 TFLOPS (624 with sparsity); {MEGATRON} uses "
                        "the same 312 teraFLOP/s as the A100's 16-bit peak",
          "fp8_flops": f"{A100_DATASHEET}: no FP8 row (FP16, BF16, TF32, INT8, INT4 only); FP8 came with Hopper",
          "hbm_bytes": f"{A100_DATASHEET}: GPU memory 80GB HBM2e",
          "hbm_bandwidth": f"{A100_DATASHEET}: 2,039 GB/s for the 80GB SXM part",
          "fast_link_bandwidth": f"{A100_DATASHEET}: NVLink 600 GB/s, both directions added; one direction "
                                 f"600 / 2 = 300 GB/s, as in {BOOK_GPUS}, Networking table (Ampere: 12 links "
                                 "x 25 GB/s = 300 GB/s full-duplex)",
          "slow_link_bandwidth": f"{MEGATRON}: each DGX A100 node has eight 200 Gbps HDR InfiniBand HCAs for "
                                 "application traffic; 8 x 200 Gb/s / 8 GPUs = 200 Gb/s = 25 GB/s per GPU",
          "fast_group": f"{MEGATRON}: 8 A100s per node over NVLink and NVSwitch; {BOOK_GPUS}: node size 8",
          "host_bytes": f"{MLPERF_A100}: host_memory_capacity '1TB' for 8 GPUs; 1 TB / 8 = 125 GB per GPU",
      })


def _hopper(name: str, description: str, hbm_bytes: float, hbm_bandwidth: float, page: str,
            memory_source: str, host_bytes: float, host_source: str) -> DeviceKind:
  """H100 and H200 are the same GH100 compute and NVLink 4; they differ in memory only."""
  return DeviceKind(
      name=name, description=description,
      bf16_flops=989.5e12, fp8_flops=1979e12, hbm_bytes=hbm_bytes, hbm_bandwidth=hbm_bandwidth,
      fast_link_bandwidth=450e9, slow_link_bandwidth=50e9, fast_group=8, host_bytes=host_bytes,
      sources={
          "bf16_flops": f"{page}: SXM BF16 Tensor Core 1,979 TFLOPS with sparsity; dense 1,979 / 2 = 989.5 "
                        f"TFLOPS ({BOOK_GPUS}, spec table: 9.9e14)",
          "fp8_flops": f"{page}: SXM FP8 Tensor Core 3,958 TFLOPS with sparsity; dense 3,958 / 2 = 1,979 "
                       f"TFLOPS ({BOOK_GPUS}, spec table: 2.0e15)",
          "hbm_bytes": memory_source,
          "hbm_bandwidth": memory_source,
          "fast_link_bandwidth": f"{page}: NVLink 900 GB/s, both directions added; one direction 450 GB/s, as "
                                 f"in {BOOK_GPUS}, Networking table (Hopper: 18 links x 25 GB/s = 450 GB/s)",
          "slow_link_bandwidth": f"{BOOK_GPUS}, 'Beyond the node level': the reference node has 8 x 400 Gbps "
                                 f"ConnectX-7 NICs, one per GPU; {HGX_FACTORY_RA}: '2-8-9-400', 400 Gb/s per "
                                 "GPU; 400 Gb/s = 50 GB/s per GPU",
          "fast_group": f"{BOOK_GPUS}, Networking table: Hopper node (NVLink domain) of 8 GPUs",
          "host_bytes": host_source,
      })


def _b200() -> DeviceKind:
  return DeviceKind(
      name="b200", description="NVIDIA B200 (HGX/DGX B200, 180 GB)",
      bf16_flops=2.25e15, fp8_flops=4.5e15, hbm_bytes=180e9, hbm_bandwidth=8e12,
      fast_link_bandwidth=900e9, slow_link_bandwidth=50e9, fast_group=8, host_bytes=1.8e12 / 8,
      sources={
          "bf16_flops": f"{HGX_PAGE}: FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity; dense 2.25 "
                        f"PFLOPS ({BOOK_GPUS}, spec table: 2.3e15, text: 2250e12)",
          "fp8_flops": f"{HGX_PAGE}: FP8/FP6 Tensor Core 9 PFLOPS per GPU with sparsity; dense 4.5 PFLOPS "
                       f"({BOOK_GPUS}, spec table: 4.5e15)",
          "hbm_bytes": f"{DGX_B200_GUIDE}: 8 B200 GPUs with 1,440 GB total GPU memory; 1,440 / 8 = 180 GB per "
                       f"GPU (the HGX B200 column lists 180GB HBM3E; {BOOK_GPUS} lists the chip's 192GB)",
          "hbm_bandwidth": "NVIDIA DGX B200 page, https://www.nvidia.com/en-us/data-center/dgx-b200/ (as summarized "
                           "at https://brent-newsom-nvidia.github.io/AIPS-Boom/wiki/NVIDIA-DGX-B200): 64 TB/s "
                           f"HBM3e for 8 GPUs; 64 / 8 = 8 TB/s ({BOOK_GPUS}, spec table: 8.0e12; a later "
                           "HGX B200 column says 7.7TB/s)",
          "fast_link_bandwidth": f"{HGX_PAGE}: fifth-generation NVLink 1.8TB/s per GPU, both directions added; "
                                 f"one direction 900 GB/s, as in {BOOK_GPUS}, Networking table (Blackwell: 18 "
                                 f"links x 50 GB/s); {DGX_B200_GUIDE}: 14.4 TB/s aggregate = 8 x 1.8 TB/s",
          "slow_link_bandwidth": f"{DGX_B200_GUIDE}: 8 ConnectX-7 single-port cards for the cluster network; "
                                 f"{HGX_FACTORY_RA}: 400 Gb/s per GPU; 400 Gb/s = 50 GB/s per GPU",
          "fast_group": f"{BOOK_GPUS}, Networking table: Blackwell B200 node of 8 GPUs (72 for GB200 NVL72)",
          "host_bytes": f"{MLPERF_B200}: host_memory_capacity '1.8 TB' for 8 GPUs; 1.8 TB / 8 = 225 GB per GPU",
      })


def _tpu_ici(per_link: float, links: int, generation: str, vendor: str) -> str:
  """The source line of a TPU's ICI figure: one direction out of a chip, all its links at once."""
  return (f"{BOOK_TPUS}, interconnect table: {generation} 'ICI BW/link (one-way)' {per_link:.2g} bytes/s; "
          f"{links} links per chip; {links} x {per_link:.2g} = {links * per_link:.3g} bytes/s; {vendor}")


def _tpu_v4() -> DeviceKind:
  return DeviceKind(
      name="tpu_v4", description="Google Cloud TPU v4",
      bf16_flops=275e12, fp8_flops=None, hbm_bytes=32 * GIB, hbm_bandwidth=1200e9,
      fast_link_bandwidth=6 * 4.5e10, slow_link_bandwidth=6.25e9, fast_group=4096, host_bytes=None,
      sources={
          "bf16_flops": f"{TPU_V4_DOCS}: peak compute per chip 275 teraflops (bf16 or int8)",
          "fp8_flops": f"{TPU_V4_DOCS}: lists bf16 and int8 only",
          "hbm_bytes": f"{TPU_V4_DOCS}: HBM2 capacity and bandwidth 32 GiB, 1200 GBps",
          "hbm_bandwidth": f"{TPU_V4_DOCS}: HBM2 capacity and bandwidth 32 GiB, 1200 GBps",
          "fast_link_bandwidth": _tpu_ici(4.5e10, 6, "TPU v4p", "6 because v4 links to its 6 nearest "
                                          f"neighbours (3D torus, {BOOK_TPUS}); {TPU_V4_DOCS} gives no "
                                          "per-chip ICI figure"),
          "slow_link_bandwidth": f"not found for v4 specifically; from {BOOK_TPUS}: DCN 'typically around "
                                 "6.25e9 bytes / second per TPU' (its exceptions are v5e, v6e and TPU7x)",
          "fast_group": f"{TPU_V4_DOCS}: TPU Pod size 4096 chips",
          "host_bytes": NO_TPU_OFFLOAD,
      })


def _tpu_v5e() -> DeviceKind:
  return DeviceKind(
      name="tpu_v5e", description="Google Cloud TPU v5e",
      bf16_flops=197e12, fp8_flops=None, hbm_bytes=16e9, hbm_bandwidth=819e9,
      fast_link_bandwidth=4 * 4.5e10, slow_link_bandwidth=25 * GBIT, fast_group=256, host_bytes=None,
      sources={
          "bf16_flops": f"{TPU_V5E_DOCS}: peak compute per chip (bf16) 197 TFLOPs",
          "fp8_flops": f"{TPU_V5E_DOCS}: lists bf16 and Int8 (393) only",
          "hbm_bytes": f"{TPU_V5E_DOCS}: HBM2 capacity and bandwidth 16 GB, 819 GBps ({BOOK_TPUS} says 16GiB; "
                       "the smaller reading is kept)",
          "hbm_bandwidth": f"{TPU_V5E_DOCS}: HBM2 capacity and bandwidth 16 GB, 819 GBps",
          "fast_link_bandwidth": _tpu_ici(4.5e10, 4, "TPU v5e", f"4 from {TPU_V6E_DOCS}: ICI ports per chip 4 "
                                          f"(2D torus); {TPU_V5E_DOCS} states 1600 Gbps = 200 GB/s"),
          "slow_link_bandwidth": f"{TPU_V6E_DOCS}, v5e column: per-host NIC 2 x 100 Gbps for 8 chips, and DCN "
                                 "6.4 Tbps per 256-chip pod; either way 25 Gb/s = 3.125e9 bytes/s per chip "
                                 f"({BOOK_TPUS}: 3.125e9)",
          "fast_group": f"{TPU_V5E_DOCS}: TPU Pod size 256 chips",
          "host_bytes": NO_TPU_OFFLOAD,
      })


def _tpu_v5p() -> DeviceKind:
  return DeviceKind(
      name="tpu_v5p", description="Google Cloud TPU v5p",
      bf16_flops=459e12, fp8_flops=459e12, hbm_bytes=95 * GIB, hbm_bandwidth=2765e9,
      fast_link_bandwidth=6 * 9e10, slow_link_bandwidth=50 * GBIT, fast_group=6144, host_bytes=None,
      sources={
          "bf16_flops": f"{TPU_V5P_DOCS}: peak compute per chip (BF16) (TFLOPs) 459",
          "fp8_flops": f"{TPU_V5P_DOCS}: peak compute per chip (FP8) (TFLOPs) 459, the same as bf16: fp8 "
                       "gains nothing on v5p",
          "hbm_bytes": f"{TPU_V5P_DOCS}: HBM capacity per chip (GiB) 95 ({BOOK_TPUS} rounds to 96GB)",
          "hbm_bandwidth": f"{TPU_V5P_DOCS}: HBM bandwidth per chip (GBps) 2765 ({BOOK_TPUS}: 2.8e12)",
          "fast_link_bandwidth": _tpu_ici(9e10, 6, "TPU v5p", "6 because v5p links to its 6 nearest "
                                          f"neighbours (3D torus); {TPU_V5P_DOCS} states bidirectional ICI "
                                          "per chip 1200 GBps, i.e. 600 GB/s one way"),
          "slow_link_bandwidth": f"{TPU_V5P_DOCS}: data center network (DCN) bandwidth per chip (Gbps) 50 = "
                                 f"6.25e9 bytes/s ({BOOK_TPUS}: 6.25e9)",
          "fast_group": f"{TPU_V5P_DOCS}: the largest job that can be scheduled is 6144 chips (16x16x24); the "
                        "pod has 8960, joined beyond 6144 only by Multislice over DCN",
          "host_bytes": NO_TPU_OFFLOAD,
      })


def _tpu_v6e() -> DeviceKind:
  return DeviceKind(
      name="tpu_v6e", description="Google Cloud TPU v6e (Trillium)",
      bf16_flops=918e12, fp8_flops=None, hbm_bytes=32e9, hbm_bandwidth=1640e9,
      fast_link_bandwidth=4 * 9e10, slow_link_bandwidth=100 * GBIT, fast_group=256, host_bytes=None,
      sources={
          "bf16_flops": f"{TPU_V6E_DOCS}: peak compute per chip (bf16) 918 TFLOPs ({BOOK_TPUS}: 9.20e14)",
          "fp8_flops": f"{TPU_V6E_DOCS}: lists bf16 and Int8 (1836 TOPs) only",
          "hbm_bytes": f"{TPU_V6E_DOCS}: HBM capacity per chip 32 GB",
          "hbm_bandwidth": f"{TPU_V6E_DOCS}: HBM bandwidth per chip 1640 GBps (an earlier version: 1600; "
                           f"{BOOK_TPUS}: 1.6e12)",
          "fast_link_bandwidth": _tpu_ici(9e10, 4, "TPU v6e", f"4 from {TPU_V6E_DOCS}: ICI ports per chip 4 "
                                          "(2D torus); the page states ICI 3584 Gbps = 448 GB/s (earlier "
                                          "versions: 3200 Gbps, or 800 GBps bidirectional)"),
          "slow_link_bandwidth": f"{TPU_V6E_DOCS}: per-host NIC 4 x 200 Gbps for 8 chips, and DCN 25.6 Tbps "
                                 "per 256-chip pod; either way 100 Gb/s = 12.5e9 bytes/s per chip "
                                 f"({BOOK_TPUS}: 12.5e9)",
          "fast_group": f"{TPU_V6E_DOCS}: TPU Pod size 256 chips",
          "host_bytes": NO_TPU_OFFLOAD,
      })


KINDS: dict[str, DeviceKind] = {kind.name: kind for kind in (
    _a100(),
    _hopper("h100", "NVIDIA H100 SXM5 80 GB", 80e9, 3.35e12, H100_PAGE,
            f"{H100_PAGE}: H100 SXM GPU memory 80GB, bandwidth 3.35TB/s ({BOOK_GPUS}: 80GB, 3.35TB/s)",
            2e12 / 8, f"{MLPERF_H100}: host_memory_capacity '2 TB' for 8 GPUs; 2 TB / 8 = 250 GB per GPU"),
    _hopper("h200", "NVIDIA H200 SXM 141 GB", 141e9, 4.8e12, H200_PAGE,
            f"{H200_PAGE}: H200 SXM GPU memory 141GB, bandwidth 4.8TB/s ({BOOK_GPUS}, spec tables: 141GB, "
            "4.8e12)",
            2e12 / 8, f"{MLPERF_H200}: host_memory_capacity '2 TB' for 8 GPUs; 2 TB / 8 = 250 GB per GPU"),
    _b200(), _tpu_v4(), _tpu_v5e(), _tpu_v5p(), _tpu_v6e())}


@dataclasses.dataclass(frozen=True)
class Cluster:
  kind: DeviceKind
  devices: int
  fast_group: int  # devices per fast-tier group (a node or a slice)
  slow_link_bandwidth: float  # bytes/s per device across groups

  @property
  def groups(self) -> int:
    return self.devices // self.fast_group


def cluster(kind: str, devices: int, fast_group: int | None = None,
            slow_link_bandwidth: float | None = None) -> Cluster:
  """`devices` of `kind`, in groups of the kind's usual size and with its usual slow link unless given.

  A cluster smaller than one group is one group of `devices` (4 GPUs of an 8-GPU node are all on
  NVLink); a larger one must be whole groups, since a part-group would have a different fast tier.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown device kind {kind!r}; give one of {', '.join(KINDS)}.")
  if devices < 1:
    raise ValueError(f"devices={devices} is not a positive count; give 1 or more.")
  device_kind = KINDS[kind]
  group = device_kind.fast_group if fast_group is None else fast_group
  if group < 1:
    raise ValueError(f"fast_group={group} is not a positive count; give the devices per node or slice, "
                     f"e.g. {device_kind.fast_group} for {kind}.")
  group = min(group, devices)
  if devices % group:
    raise ValueError(f"fast_group={group} does not divide devices={devices}; give whole groups (a multiple "
                     f"of {group} devices) or a fast_group that divides {devices}.")
  slow = device_kind.slow_link_bandwidth if slow_link_bandwidth is None else slow_link_bandwidth
  if slow <= 0:
    raise ValueError(f"slow_link_bandwidth={slow} is not positive; give bytes/s per device across groups, "
                     f"e.g. {device_kind.slow_link_bandwidth:.3g} for {kind}.")
  return Cluster(kind=device_kind, devices=devices, fast_group=group, slow_link_bandwidth=slow)
