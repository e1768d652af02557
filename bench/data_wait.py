#!/usr/bin/env python3
"""What ``stripefs.torch.watch`` costs a training loop per step (issue 32's goal: under 20 us).

    .venv/bin/python bench/data_wait.py [--steps 200000] [--rounds 5]

A loop over ready batches (nothing to wait for) with an empty step, bare and
wrapped in ``watch``; the difference per step is the meter's cost (two
perf_counter calls and a few additions; the report to the mount once a second
is a getxattr, not counted here: no mount). Printed beside the bare loop of the
same run, as every figure of bench/ is, with the range of ``--rounds`` rounds.
Without CUDA: the CUDA path adds two event records per step and is measured
only where a GPU is lent.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stripefs.data_wait import watch


def _loop(batches) -> float:
    start = time.perf_counter()
    for _ in batches:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    costs, bares = [], []
    for _ in range(args.rounds):
        bare = _loop(range(args.steps))
        watched = _loop(watch(range(args.steps), cuda=False))
        bares.append(bare / args.steps * 1e6)
        costs.append((watched - bare) / args.steps * 1e6)
    cost = statistics.median(costs)
    print(f"{'row':<44}{'median':>10}{'range':>22}{'goal':>10}")
    print(f"{'bare loop, us a step':<44}{statistics.median(bares):>10.3f}{f'{min(bares):.3f}-{max(bares):.3f}':>22}{'':>10}")
    print(f"{'watch() cost, us a step':<44}{cost:>10.3f}{f'{min(costs):.3f}-{max(costs):.3f}':>22}{'<= 20':>10}"
          f"  {'PASS' if cost <= 20 else 'BELOW'}")


if __name__ == "__main__":
    main()
