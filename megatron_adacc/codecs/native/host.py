"""Which CPU this is, as far as the native build and the profiles must tell CPUs apart.

A virtual machine's model name is often the make alone. "AMD EPYC" has been a Zen 4 (family 25) and
a Zen 5 (family 26) on this project's machines. "Intel(R) Xeon(R) Processor" covers generations with
and without AVX-512. A library built with -march=native on one may use instructions the other lacks.
Codec timings taken on one mislead plans on the other: outlier_int4's round trip was 0.54 of a copy
on the Zen 4's AVX2 path, 0.39-0.43 on the Zen 5's. So the CPU is named by its model name with its
family and model numbers. A build is keyed by those and the instruction-set flags the kernel
reports.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class HostCpu:
    model: str                   # the model name (platform.processor() where /proc/cpuinfo
                                 # has none)
    family: int | None = None    # "cpu family" (x86)
    model_number: int | None = None  # "model" (x86)
    flags: frozenset[str] = frozenset()

    def describe(self) -> str:
        """The model name, with the family and model numbers where there are some.

        For example "AMD EPYC (family 25, model 17)"."""
        if self.family is None:
            return self.model
        return f"{self.model} (family {self.family}, model {self.model_number})"

    def build_identity(self) -> str:
        """What a -march=native build depends on: the CPU as described and every flag."""
        return f"{self.describe()} [{' '.join(sorted(self.flags))}]"


def parse_cpuinfo(text: str) -> HostCpu:
    """The first processor's entry of a /proc/cpuinfo text; fields it lacks stay unknown.

    Every core of a machine is alike here."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's entry
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        try:
            return int(fields[key])
        except (KeyError, ValueError):
            return None

    family = number("cpu family")
    return HostCpu(model=fields.get("model name") or platform.processor() or "cpu",
                   family=family, model_number=number("model") if family is not None else None,
                   flags=frozenset(fields.get("flags", "").split()))


@functools.cache
def host_cpu() -> HostCpu:
    """This machine's CPU (read once a process)."""
    try:
        with open(CPUINFO) as info:
            return parse_cpuinfo(info.read())
    except OSError:
        return parse_cpuinfo("")
