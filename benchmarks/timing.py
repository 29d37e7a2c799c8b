"""Timing whole processes on a shared machine: each in its own session with the highest group priority.

`nice` on other work does not protect a timing here: the kernel schedules per session group (autogroup), so a
niced process of another session still gets an equal share. A timed process in a new session whose autogroup has
priority -20 does get the machine (writing it needs root; without root this changes nothing and says so once).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

_warned = False


def raise_priority() -> None:
    """Give the calling process's session group the highest priority (called in a child before exec)."""
    try:
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass


def priority_available() -> bool:
    return os.geteuid() == 0 and Path("/proc/self/autogroup").exists()


def run_timed(cmd: list[str], cwd: Path | str | None = None, env: dict | None = None,
              priority: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of one process run to its end (output captured), and its result; raises on a non-zero exit.

    The process runs with Python's default bytecode cache, as a user's does (a wheel's install compiles it, an
    editable checkout writes it on first import): a machine that sets PYTHONDONTWRITEBYTECODE (this project's
    sandboxes do) makes every process compile the imported sources again, ~0.07 s of `gptlab train`'s start-up.
    Time a first run apart (it writes the cache)."""
    global _warned
    if priority and not priority_available() and not _warned:
        print("note: not root, timed processes run at normal priority (expect more noise)")
        _warned = True
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "2")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, start_new_session=True,
                       preexec_fn=raise_priority if priority else None)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} ... exited {r.returncode}: {r.stderr[-1500:]}")
    return wall, r


def loadavg() -> str:
    """The 1-minute load average, printed beside each timed round ("?" where /proc is missing)."""
    load = Path("/proc/loadavg")
    return load.read_text().split()[0] if load.exists() else "?"


def cpu_flags() -> str:
    """The CPU's vector flags that matter for these kernels (gptlab.hardware reads them)."""
    from gptlab.hardware import cpu_flags as all_flags  # benchmarks that time start-up import gptlab late

    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
              "amx_bf16", "amx_int8", "amx_tile", "f16c")
    have = all_flags()
    return " ".join(f for f in wanted if f in have) or ("none of " + " ".join(wanted) if have else "?")
