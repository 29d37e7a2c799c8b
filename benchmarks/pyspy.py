"""Sampling profiles of a running process with py-spy (`pip install py-spy`): where each thread spends its time.

`Recording(pid, path)` attaches py-spy to a process and samples it (raw collapsed stacks, one thread's stacks apart
from another's) until `stop()`; `summarize(path)` turns the samples into a few lines: each thread's share of the
samples, and within it the functions that held the most (inclusive: a function counts while anything it called
runs). Idle threads are not sampled (py-spy's default), so the shares are of busy time.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

_THREAD = re.compile(r"^thread \((\w+)\)(?:: (.*))?$")


class Recording:
    """py-spy sampling process `pid` into `path` from now until `stop()`."""

    def __init__(self, pid: int, path: Path, rate: int = 100) -> None:
        # on PATH, or beside this Python (a virtual environment's bin/, not activated)
        exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        self.path = path
        cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--rate", str(rate),
               "--output", str(path), "--nonblocking"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        """Stop sampling and write the file (py-spy writes it on Ctrl-C)."""
        self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError("py-spy did not stop within 30 s") from None
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.strip()[-500:]}")


def summarize(path: Path, top: int = 8) -> str:
    """Each thread's share of the samples and the functions holding most of it (inclusive), as text."""
    per_thread: collections.Counter[str] = collections.Counter()
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    names: dict[str, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        match = _THREAD.match(frames[0])
        if match is None:
            continue
        thread = match.group(1)
        if match.group(2):
            names[thread] = match.group(2)
        per_thread[thread] += int(count)
        # a function once per stack (recursion must not count twice); "name (file:line)" -> "name (file)"
        for function in {re.sub(r":\d+\)$", ")", f) for f in frames[1:]}:
            functions[thread][function] += int(count)
    total = sum(per_thread.values()) or 1
    out = [f"{total} samples"]
    for thread, n in per_thread.most_common():
        out.append(f"  thread {names.get(thread, thread)}: {100 * n / total:.0f}% of the samples")
        # functions on (almost) every stack of the thread (its run loop) say nothing: left out
        shown = [(f, m) for f, m in functions[thread].most_common() if m < 0.98 * n][:top]
        for function, m in shown:
            out.append(f"    {100 * m / total:5.1f}%  {function}")
    return "\n".join(out)
