"""Sum pytest's `--durations=0` lines of a CI log by file and by test function, per phase.

    python .ci/durations.py LOG [--top N]

CI prints them when run with `PYTEST_ADDOPTS=--durations=0` (`CI=true PYTEST_ADDOPTS=--durations=0
bash .ci/run > LOG 2>&1`). Each phase's table is its own `slowest durations` block; the seconds
are worker-seconds (with `-n 2`, about twice the wall time).
"""

from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+?)::(\S+)")


def phases(lines: list[str]) -> list[list[tuple[float, str, str]]]:
    out: list[list[tuple[float, str, str]]] = []
    current: list[tuple[float, str, str]] | None = None
    for line in lines:
        if re.search(r"slowest (\d+ )?durations", line):
            current = []
            out.append(current)
            continue
        if current is None:
            continue
        m = LINE.match(line)
        if m:
            secs, _, path, test = m.groups()
            current.append((float(secs), path, test.split("[")[0]))
        elif line.startswith("=") and current:
            current = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    with open(a.log, encoding="utf-8", errors="replace") as fh:
        blocks = phases(fh.read().splitlines())
    for k, rows in enumerate(blocks, 1):
        total = sum(s for s, _, _ in rows)
        print(f"## phase {k}: {len(rows)} timed entries, {total:.0f} worker-seconds")
        for title, key in (("file", lambda r: r[1]), ("test function", lambda r: f"{r[1]}::{r[2]}")):
            sums: dict[str, float] = collections.defaultdict(float)
            for r in rows:
                sums[key(r)] += r[0]
            print(f"\nby {title}:")
            for name, s in sorted(sums.items(), key=lambda kv: -kv[1])[: a.top]:
                print(f"  {s:7.0f} s  {100 * s / total:4.1f}%  {name}")
        print()


if __name__ == "__main__":
    main()
