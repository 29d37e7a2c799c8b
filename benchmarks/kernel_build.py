"""How long a first run waits for gptlab's C++ kernels to build: each build this CPU runs (AVX2, AVX-VNNI, AVX-512,
AMX), compiled from scratch as gptlab builds it (its sources in one unity file per core, `kernels.build.unity_sources`)
and as one translation unit per source, the two forms taking turns over --rounds.

    python benchmarks/kernel_build.py                 # every build this CPU runs, 2 rounds
    python benchmarks/kernel_build.py --builds avx2 --rounds 3

Each compile is a fresh process (`torch.utils.cpp_extension.load` into an empty build directory, at raised priority:
benchmarks/timing.py) with the flags gptlab builds with. Printed per build and form: the median wall seconds, the
CPU seconds of the compilers (the process's children), and the ratio per source / unity. The compiler's own work
does not depend on what else the machine runs, so the CPU seconds are the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from timing import cpu_flags, loadavg, run_timed  # benchmarks/ is on sys.path when a benchmark runs as a script

import gptlab.kernels as kernels
from gptlab.hardware import usable_cores

FLAGS = {"avx2": kernels.AVX2_FLAGS, "avxvnni": kernels.AVXVNNI_FLAGS, "avx512": kernels.AVX512_FLAGS,
         "amx": kernels.AMX_FLAGS}
RUNS = {"avx2": kernels.cpu_has_avx2, "avxvnni": kernels.cpu_has_avxvnni, "avx512": kernels.cpu_has_avx512,
        "amx": kernels.cpu_has_amx}

CHILD = """
import resource, sys
from pathlib import Path
from torch.utils.cpp_extension import load
import gptlab.kernels as k
from gptlab.kernels.build import unity_sources
directory, count, name, flags = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
units = unity_sources(k.SOURCES, directory / "unity", count)
load(name=name, sources=[str(u) for u in units], build_directory=str(directory), is_python_module=False,
     verbose=False, extra_cflags=[*k._COMMON_FLAGS, *flags], extra_ldflags=["-fopenmp"])
used = resource.getrusage(resource.RUSAGE_CHILDREN)
print(used.ru_utime + used.ru_stime)
"""


def compile_once(build: str, count: int, name: str) -> tuple[float, float]:
    """Wall and compiler CPU seconds of one build of `build`'s sources as `count` unity files, from scratch."""
    with tempfile.TemporaryDirectory(prefix="gptlab-build-") as directory:
        wall, done = run_timed([sys.executable, "-c", CHILD, directory, str(count), name, *FLAGS[build]])
    return wall, float(done.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", nargs="*", choices=list(FLAGS), help="default: every build this CPU runs")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    builds = args.builds or [b for b in FLAGS if RUNS[b]()]
    cores = usable_cores()
    forms = {"unity": cores, "per source": len(kernels.SOURCES)}
    print(f"CPU flags: {cpu_flags()}; {cores} cores; {len(kernels.SOURCES)} sources; builds: {' '.join(builds)}")
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(b, f): [] for b in builds for f in forms}
    for r in range(args.rounds):
        print(f"round {r + 1} (load {loadavg()})", flush=True)
        for build in builds:
            order = list(forms) if r % 2 == 0 else list(reversed(forms))  # each form first in turn
            for form in order:
                wall, cpu = compile_once(build, forms[form], f"bench_{build}_{form.replace(' ', '_')}_{r}")
                times[build, form].append((wall, cpu))
                print(f"  {build:8s} {form:10s} {wall:6.1f} s wall, {cpu:6.1f} s of compiler CPU", flush=True)
    for build in builds:
        med = {f: (statistics.median(w for w, _ in times[build, f]), statistics.median(c for _, c in times[build, f]))
               for f in forms}
        (uw, uc), (pw, pc) = med["unity"], med["per source"]
        print(f"median {build}: unity files ({cores}) {uw:.1f} s wall, {uc:.1f} s CPU; one unit per source {pw:.1f} s "
              f"wall, {pc:.1f} s CPU: unity {pw / uw:.2f}x faster ({pc / uc:.2f}x less CPU)")


if __name__ == "__main__":
    main()
