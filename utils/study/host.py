"""The machine a record was made on, and the software a report was written with."""
from __future__ import annotations

import collections
import contextlib
import os
import platform
from pathlib import Path


def software_versions() -> str:
    import importlib.metadata as md

    names = ("torch", "transformers", "tokenizers", "datasets", "lm_eval", "numpy", "matplotlib")
    return ", ".join(f"{n} {md.version(n)}" for n in names)


def cpuinfo_field(name: str) -> str | None:
    """The first `name : value` of /proc/cpuinfo ("model name", "flags", ...); None where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, colon, value = line.partition(":")
            if colon and key.strip() == name:
                return value.strip()
    return None


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    return cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def bf16_instructions() -> list[str]:
    """The CPU's bf16 matrix instructions named in /proc/cpuinfo (none on CPUs whose cpuinfo says "Features")."""
    flags = (cpuinfo_field("flags") or "").split()
    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]


def records_machines(records: dict[str, dict]) -> str:
    """Where the records were made, as each says (a report rewritten with --report_only may be written elsewhere)."""
    counts = collections.Counter(record.get("machine") for record in records.values())
    made = [f"{machine} ({count} runs)" for machine, count in counts.items() if machine]
    if counts.get(None):
        made.append(f"not recorded for {counts[None]} runs (records made before a record named its machine)")
    return "; ".join(made) or "no records yet"


def machine_description(device: str = "cpu") -> str:
    """The host; with device "cuda", its GPU first."""
    host = (f"{platform.machine()}, {cpu_model_name()}, {os.cpu_count()} cores, bf16 instructions: "
            f"{', '.join(bf16_instructions()) or 'none'}, Python {platform.python_version()}")
    if device != "cuda":
        return host
    import torch

    return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}) on {host}"


def cpu_of(record: dict) -> str:
    """The CPU model a record names ("AMD EPYC", "Intel Xeon Processor"), or that it names none."""
    machine = (record.get("machine") or "an unrecorded host").split(", ")
    return (machine[1] if len(machine) > 1 else machine[0]).replace("(R)", "")

