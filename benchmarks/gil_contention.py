"""What a busy Python thread beside the engine costs its decode steps: the server's GIL contention, measured alone.

`gptlab serve` runs the engine on a scheduler thread and HTTP on the event loop's thread of the same process. The
engine's step releases the GIL at every ATen op and at the C++ step; while the event loop is busy (streaming a step's
chunks), each time the engine wants the GIL back it waits for the loop to block or for the interpreter's switch
interval (5 ms by default) to run out. This benchmark times the engine's decode steps at --batch rows (a random
--preset model, --dtype) while a competitor runs a duty cycle of pure Python work (--busy-ms busy, --idle-ms asleep,
as the event loop's burst per step), in four settings taking turns over --rounds:

* alone: no competitor (the offline engine);
* alone, on another thread: no competitor, the steps on a thread other than the one that loaded the model, as the
  server's scheduler runs them (the model's first forwards made the main thread an OpenMP team of its own: with two
  teams on two cores, libgomp makes idle threads sleep almost at once);
* thread: the competitor on a thread of this process, the default switch interval;
* thread, short interval: the same with `sys.setswitchinterval(--interval-ms)`;
* process: the competitor in a process of its own (what an engine process apart from the HTTP process gives):
  it shares the cores, not the GIL.

Each round runs them twice, in a fresh process per OpenMP wait policy: unset (libgomp's idle threads spin a while
before they sleep) and passive (they sleep at once: the core is free for the competitor, each parallel region wakes
them). It prints the median step per setting and policy, and its ratio to the step alone under the default policy.
On a shared machine run it in a session of its own at raised priority (see benchmarks/timing.py):

    OMP_NUM_THREADS=2 setsid sh -c 'echo -20 > /proc/self/autogroup; exec python benchmarks/gil_contention.py'
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

# OpenMP's wait policies: unset (libgomp spins a while before it sleeps: what a server gets today) or passive (idle
# pool threads sleep at once, leaving the core to other work)
POLICIES = ("default", "passive")


def duty_cycle(stop: Callable[[], bool], busy_s: float, idle_s: float) -> None:
    """Pure Python work for busy_s, then asleep for idle_s (the GIL released), until stop()."""
    while not stop():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        time.sleep(idle_s)


def _duty_process(ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event, busy_s: float,
                  idle_s: float) -> None:
    ready.set()
    duty_cycle(done.is_set, busy_s, idle_s)


def engine_steps(preset: str, dtype: torch.dtype, batch: int) -> Callable[[int], float]:
    """A function timing n decode steps of a full batch of a random model: the median step in seconds."""
    from gptlab import GPT, GPTConfig
    from gptlab.generation import SamplingParams
    from gptlab.generation.engine import Engine

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, vocab_size=96)).to(dtype).eval()
    engine = Engine(model, max_batch=batch)
    params = SamplingParams(max_new_tokens=model.config.block_size, temperature=0.8, ignore_eot=True)

    def steps(n: int) -> float:
        if len(engine.running) < batch or any(len(g.row.window) + n + 2 >= engine.max_len for g in engine.running):
            for g in engine.running:
                engine.release(g)
            engine.add([engine.prepare([1, 2, 3], params, sample_index=i) for i in range(batch)])
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return steps


def with_thread(steps: Callable[[int], float], n: int, busy_s: float, idle_s: float, interval: float | None) -> float:
    stop = False
    default = sys.getswitchinterval()
    if interval is not None:
        sys.setswitchinterval(interval)
    competitor = threading.Thread(target=duty_cycle, args=(lambda: stop, busy_s, idle_s), daemon=True)
    competitor.start()
    try:
        return steps(n)
    finally:
        stop = True
        competitor.join()
        sys.setswitchinterval(default)


def on_thread(steps: Callable[[int], float], n: int) -> float:
    """The steps on a thread other than the one that loaded the model (where the server's scheduler runs them)."""
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(steps(n)))
    worker.start()
    worker.join()
    return result[0]


def with_process(steps: Callable[[int], float], n: int, busy_s: float, idle_s: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    competitor = ctx.Process(target=_duty_process, args=(ready, done, busy_s, idle_s), daemon=True)
    competitor.start()
    # a spawned child imports this module, and so torch: ~1-2 s of a core, which a fixed wait here timed as the
    # competitor's cost (the step looked 2.4x slower)
    if not ready.wait(timeout=120):
        raise RuntimeError("the competitor process did not start")
    try:
        return steps(n)
    finally:
        done.set()
        competitor.join(timeout=10)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One round in this process: the median decode step (seconds) per setting, the settings taking turns."""
    steps = engine_steps(args.preset, getattr(torch, args.dtype), args.batch)
    steps(20)  # warm-up: packs, the dispatch's choice
    busy, idle, n = args.busy_ms / 1000, args.idle_ms / 1000, args.steps
    settings: dict[str, Callable[[], float]] = {
        "alone": lambda: steps(n),
        "alone, on another thread": lambda: on_thread(steps, n),
        "thread": lambda: with_thread(steps, n, busy, idle, None),
        f"thread, interval {args.interval_ms:g} ms": lambda: with_thread(steps, n, busy, idle, args.interval_ms / 1000),
        "process": lambda: with_process(steps, n, busy, idle),
    }
    return {name: run() for name, run in settings.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="pocket-swiglu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed per setting and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-ms", type=float, default=1.0, help="the competitor's Python work per cycle")
    ap.add_argument("--idle-ms", type=float, default=2.0, help="the competitor's sleep per cycle")
    ap.add_argument("--interval-ms", type=float, default=0.2, help="the short switch interval")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one round, as JSON
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    print(f"random {args.preset} ({args.dtype}), batch {args.batch}; competitor: {args.busy_ms:g} ms of Python "
          f"work, {args.idle_ms:g} ms asleep, per cycle; default switch interval {sys.getswitchinterval() * 1000:g} ms")
    times: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for policy in POLICIES:  # each round a fresh process per OpenMP wait policy, taking turns
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            env |= {} if policy == "default" else {"OMP_WAIT_POLICY": policy}
            out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, check=True,
                                 capture_output=True, text=True).stdout
            for name, t in json.loads(out.splitlines()[-1]).items():
                times[f"{name}, OMP {policy}"].append(t)
        print(f"round {r + 1} done (load {loadavg()})")
    base = statistics.median(times[f"alone, OMP {POLICIES[0]}"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"median decode step, {name}: {med * 1000:.2f} ms = {args.batch / med:.0f} tokens/s, "
              f"{med / base:.2f}x the time alone with OMP {POLICIES[0]}")


if __name__ == "__main__":
    main()
