"""This machine's float32 matrix product rate with numpy: the yardstick printed beside a wall
time (CI's suite time, a run's minutes), so a slow day reads as one.

    python .ci/matmul_rate.py    # one JSON line: GFLOP/s median, min and max of 7 products
"""

import json
import time

import numpy as np

SIZE = 2048  # 2 x 2048^3 FLOPs a product: about 0.02-0.1 s on a 2-core machine.


def main(repeats: int = 7) -> dict:
  rng = np.random.default_rng(0)
  a, b = (rng.random((SIZE, SIZE), dtype=np.float32) for _ in range(2))
  a @ b  # Warm-up: the BLAS threads start.
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    a @ b
    rates.append(2 * SIZE**3 / (time.perf_counter() - start) / 1e9)
  rates.sort()
  return {'bench': 'matmul_rate', 'size': SIZE, 'dtype': 'float32',
          'gflops_median': round(rates[len(rates) // 2], 1), 'gflops_min': round(rates[0], 1),
          'gflops_max': round(rates[-1], 1)}


if __name__ == '__main__':
  print(json.dumps(main()))
