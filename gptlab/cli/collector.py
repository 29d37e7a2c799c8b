"""Python's cyclic garbage collector around a gptlab command's process: its start and its end.

`import torch` creates about 170,000 long-lived objects (modules, functions, dispatch tables), many in reference
cycles. The collector scans them repeatedly while they are made, and again in the interpreter's final collections
at exit: a noticeable share of a command that takes a few seconds in all (`gptlab sample --max-new-tokens 1`).

* `import_torch_quietly`: torch imported with the collector paused, then everything alive moved to the collector's
  permanent generation (`gc.freeze`), which later collections skip; the collector runs as usual afterwards.
* `freeze_at_exit`: the same freeze in an atexit handler, which the interpreter calls before its final
  collections; the process's memory goes back to the system when it exits all the same.
* `freeze_heap`: a long-running command (`gptlab serve`), once it has loaded everything, collects once and freezes
  what is alive: the model, the app and the libraries they imported (~200,000 objects). The collector's full passes
  while it serves then skip them: each took 50-90 ms, the engine's steps waiting on the GIL meanwhile (a stall of
  every stream at once); 1.6 ms after (GPT-2's blocks in int8, 16 clients). A frozen object dropped later is still
  freed by its reference count; only a cycle among frozen objects would stay, and what a server drops while serving
  (requests, their rows, prefix-cache blocks) is made after the freeze.
"""

from __future__ import annotations

import atexit
import functools
import gc


def import_torch_quietly() -> None:
    """Import torch with the cyclic collector paused and freeze what it made."""
    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


@functools.cache  # registered once per process
def freeze_at_exit() -> None:
    """Have the interpreter's final collections skip every object still alive at exit; once per process."""
    atexit.register(gc.freeze)


def freeze_heap() -> None:
    """Collect once (no garbage is kept), then move every object alive to the permanent generation, which the
    collector's passes skip from then on."""
    gc.collect()
    gc.freeze()
