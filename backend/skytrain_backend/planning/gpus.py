"""The usual cloud GPUs: their memory, a rough price, and ``L4:1``-style specs.

Names are SkyPilot's (``A100`` is the 40 GB card). Memory is what CUDA reports as the
device's total (``torch.cuda.mem_get_info()[1]``, ``total_memory``): the figure vLLM
multiplies by ``gpu_memory_utilization`` and the one in its start-up log
(``total_gpu_memory``). ``nvidia-smi`` shows a few hundred MiB more (its ``memory.total``
includes what the driver reserves). Prices are rough on-demand list prices per GPU-hour on
the large clouds; they only order the choices (the cheapest GPU that fits is asked for) and
are never shown as a bill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1024**2
GIB = 1024**3


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_mib: int
    usd_per_hour: float
    # The memory as nvidia-smi shows it (memory.total), for operators comparing.
    smi_memory_mib: int
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPU_TYPES: tuple[GpuType, ...] = (
    GpuType("L4", 22_478, 0.71, 23_034),
    GpuType("A10G", 22_515, 1.01, 23_028),
    GpuType("L40S", 45_596, 1.86, 46_068),
    GpuType("A100", 40_536, 3.67, 40_960, aliases=("A100-40GB",)),
    GpuType("A100-80GB", 81_050, 5.07, 81_920),
    GpuType("H100", 81_090, 11.06, 81_559),
    GpuType("H200", 143_150, 12.29, 143_771),
    GpuType("B200", 182_600, 14.24, 183_359),
)
_BY_NAME = {
    name.upper(): gpu for gpu in GPU_TYPES for name in (gpu.name, *gpu.aliases)
}  # fmt: skip
_SPEC_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*(?::\s*(\d+)\s*)?$")
MAX_GPUS_PER_NODE = 16


@dataclass(frozen=True)
class GpuSpec:
    """``count`` GPUs of one type on one node; ``gpu`` None: a type the table does not know."""

    name: str
    count: int
    gpu: GpuType | None

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"

    @property
    def usd_per_hour(self) -> float | None:
        return None if self.gpu is None else self.gpu.usd_per_hour * self.count


def parse_gpu(spec: str) -> GpuSpec:
    """``'L4:1'``, ``'h100:8'`` or ``'A10G'`` (one) as a GpuSpec; ValueError for another shape.

    A name the table does not know is kept (``gpu`` None): SkyPilot may know it, the plan
    cannot say whether a model fits it.
    """
    match = _SPEC_RE.match(spec)
    if match is None:
        raise ValueError(f"GPU {spec!r} is not of the form NAME or NAME:COUNT ('L4:1', 'H100:8')")
    name, count_text = match.group(1), match.group(2)
    count = int(count_text) if count_text else 1
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise ValueError(f"GPU {spec!r} asks for {count} GPUs: a node has 1 to {MAX_GPUS_PER_NODE}")
    gpu = _BY_NAME.get(name.upper())
    return GpuSpec(gpu.name if gpu else name, count, gpu)


def gpu_named(name: str) -> GpuType | None:
    return _BY_NAME.get(name.upper())


def gpu_from_device(name: str, memory_bytes: int) -> GpuType:
    """The GPU a worker finds itself on, from CUDA's device name and total memory."""
    memory_mib = memory_bytes // MIB
    return GpuType(name=name, memory_mib=memory_mib, usd_per_hour=0.0, smi_memory_mib=memory_mib)


def gib(value: float) -> str:
    """A number of bytes in GiB, as the plans print it."""
    return f"{value / GIB:.2f} GiB"
