"""The garbage collector around a gptlab command's process (`gptlab.cli.collector`): torch imported with the
collector paused and its objects frozen, the collector on again afterwards; and the freeze at exit, registered once,
happening at exit only. Each case runs in a process of its own (a frozen collector would leak into this one)."""

from __future__ import annotations

import subprocess
import sys

AT_EXIT = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # runs after the handlers below
from gptlab.cli.collector import freeze_at_exit
before = atexit._ncallbacks()
freeze_at_exit()
freeze_at_exit()
print("handlers added:", atexit._ncallbacks() - before)
print("frozen while running:", gc.get_freeze_count() > 0)
"""

IMPORT = """
import gc, sys
from gptlab.cli.collector import import_torch_quietly
assert "torch" not in sys.modules and gc.get_freeze_count() == 0
import_torch_quietly()
print("torch imported:", "torch" in sys.modules)
print("collector on:", gc.isenabled())
print("frozen:", gc.get_freeze_count() > 100_000)
"""


def run(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_freeze_at_exit_freezes_at_exit_only_and_registers_once() -> None:
    assert run(AT_EXIT) == ["handlers added: 1", "frozen while running: False", "frozen at exit: True"]


def test_torch_is_imported_with_its_objects_frozen_and_the_collector_back_on() -> None:
    assert run(IMPORT) == ["torch imported: True", "collector on: True", "frozen: True"]


HEAP = """
import gc, weakref
from gptlab.cli.collector import freeze_heap

class Node:
    pass

alive = [Node() for _ in range(1000)]
cycle = Node()
cycle.self = cycle  # garbage only the collector frees
gone = weakref.ref(cycle)
del cycle
freeze_heap()
print("garbage collected, not frozen:", gone() is None)
print("alive frozen:", gc.get_freeze_count() >= 1000 and not any(o is alive for o in gc.get_objects()))
print("collector on:", gc.isenabled())
"""


def test_freeze_heap_frees_the_garbage_then_freezes_what_is_alive() -> None:
    assert run(HEAP) == ["garbage collected, not frozen: True", "alive frozen: True", "collector on: True"]
