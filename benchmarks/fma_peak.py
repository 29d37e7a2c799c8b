"""This x86 CPU's fp32 FMA peak: the ceiling that no fp32 matmul passes, beside the measured matmul peak that MFU is
counted against (gptlab.hardware.peak_flops: a 1,024-cubed product, what MKL or oneDNN reach).

A small C++ program runs independent fused multiply-adds on whole vector registers (AVX-512 where the compiler targets
it, else AVX2 + FMA; 12 chains a thread, more than the FMA units' latency x ports hides) with no memory traffic, on
each of `threads` OpenMP threads, and prints the best of five passes. Compiled with `c++ -march=native` into a
temporary folder (under a second); None where there is no compiler or the CPU is not x86.

    python benchmarks/fma_peak.py --threads 2      # e.g. a 2-core Zen 3: 205.3 GFLOP/s (3.2 GHz x 2 x 32)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <omp.h>
#ifdef __AVX512F__
using V = __m512;
#define SPLAT _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define FIRST(v) _mm512_cvtss_f32(v)
#else
using V = __m256;
#define SPLAT _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define FIRST(v) _mm256_cvtss_f32(v)
#endif
int main() {
  const long rounds = 40000000;  // x 12 chains x the vector's lanes x 2 FLOPs a thread
  double best = 0;
  for (int pass = 0; pass < 5; ++pass) {
    double flops = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : flops)
    {
      V a[12];
      for (int i = 0; i < 12; ++i) a[i] = SPLAT(1.0f + i * 1e-7f);
      const V b = SPLAT(0.9999999f), c = SPLAT(1e-7f);
      for (long n = 0; n < rounds; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], b, c);
      }
      float sum = 0;
      for (int i = 0; i < 12; ++i) sum += FIRST(a[i]);
      if (sum == 12345.0f) std::printf("-");  // the chains' results used: not optimized away
      flops += double(rounds) * 12 * (sizeof(V) / 4) * 2;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = flops / seconds > best ? flops / seconds : best;
  }
  std::printf("%.6e\n", best);
}
"""


def fma_peak(threads: int) -> float | None:
    """fp32 FLOP/s of `threads` threads doing nothing but fused multiply-adds, or None where it cannot be measured."""
    compiler = os.environ.get("CXX", "c++")
    if platform.machine().lower() not in ("x86_64", "amd64") or shutil.which(compiler) is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.cpp", Path(tmp) / "fma"
        source.write_text(SOURCE)
        built = subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None
        ran = subprocess.run([str(binary)], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread"})
    found = re.fullmatch(r"\s*([0-9.e+]+)\s*", ran.stdout)
    return float(found.group(1)) if ran.returncode == 0 and found else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    peak = fma_peak(args.threads)
    print("no measurement (not x86, or no C++ compiler)" if peak is None
          else f"fp32 FMA peak on {args.threads} threads: {peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
