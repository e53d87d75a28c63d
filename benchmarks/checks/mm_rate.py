"""One-off check: the rate (GFLOP/s) of this CPU's float32 matmuls at SmolLM2's layer shapes, by rows (M).

    python benchmarks/checks/mm_rate.py

kto-pipeline's packed training step runs one row of ~1,300 tokens through each linear layer where trl's padded
batch runs ~4,800 positions: if small M ran slower, our step would reach a lower rate at fewer FLOPs. Each shape:
3 warm-up products, then the mean of 20 (torch's own threads).
"""

import time

import torch

SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 6144))  # q/o projections, MLP up and down, an LM-head chunk


def rate(m: int, k: int, n: int, reps: int = 20) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n / ((time.perf_counter() - started) / reps) / 1e9


def main() -> None:
    torch.manual_seed(0)
    print("rows  " + "  ".join(f"{k}x{n}" for k, n in SHAPES) + "  (GFLOP/s)")
    for m in (160, 650, 1304, 2600, 4800):
        print(f"{m:<5} " + "  ".join(f"{rate(m, k, n):8.1f}" for k, n in SHAPES), flush=True)


if __name__ == "__main__":
    main()
