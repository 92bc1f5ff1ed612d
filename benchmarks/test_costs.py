"""The costliest tests and files of a run, from what tests/tier_costs.py records (issue 56: the unit tier took
4 minutes and 9 GB; docs/TESTING.md "Budgets").

    TEST_COSTS=/tmp/costs.tsv python -m pytest -q -m unit     # the tests' plugin writes one line per test
    python benchmarks/test_costs.py --file /tmp/costs.tsv     # ranks them: CPU s, peak memory, per file

Each line holds the node id, the tier, the wall seconds, the CPU seconds of the pytest process (and the children it
reaped) and the process's peak resident memory during that test alone. On shared cores rank by CPU seconds: the wall
time moves with the load.
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path


def report(path: Path, top: int) -> None:
    tests = [(name, tier, float(wall), float(cpu), float(peak))
             for name, tier, wall, cpu, peak in (line.split("\t") for line in path.read_text().splitlines() if line)]
    tiers: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for name, tier, wall, cpu, peak in tests:
        for entry in (tiers[tier], files[name.split("::")[0]]):
            entry[0] += 1
            entry[1] += wall
            entry[2] += cpu
            entry[3] = max(entry[3], peak)
    print("  tests  wall s   CPU s  peak MB  tier")
    for tier, (count, wall, cpu, peak) in sorted(tiers.items()):
        print(f"  {count:5d} {wall:7.1f} {cpu:7.1f} {peak:8.0f}  {tier}")
    print(f"\nthe {top} costliest tests (CPU s):\n  wall s   CPU s  peak MB  test")
    for name, _, wall, cpu, peak in sorted(tests, key=lambda t: -t[3])[:top]:
        print(f"  {wall:6.1f} {cpu:7.1f} {peak:8.0f}  {name}")
    print(f"\nthe {top} largest peaks:\n  peak MB  test")
    for name, *_, peak in sorted(tests, key=lambda t: -t[4])[:top]:
        print(f"  {peak:7.0f}  {name}")
    print(f"\nthe {top} costliest files (CPU s):\n  tests  wall s   CPU s  peak MB  file")
    for name, (count, wall, cpu, peak) in sorted(files.items(), key=lambda item: -item[1][2])[:top]:
        print(f"  {count:5d} {wall:7.1f} {cpu:7.1f} {peak:8.0f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, required=True, help="what TEST_COSTS named in the run")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    report(args.file, args.top)


if __name__ == "__main__":
    main()
