#!/usr/bin/env python3
"""Prints the slowest test binaries and tests of a cargo-nextest JUnit report.

    scripts/slowest-tests.py target/nextest/default/junit.xml [N]

A binary's time is the sum of its tests' (nextest runs several at once, so the sum
over binaries is more than the phase's wall time).
"""
import sys
import xml.etree.ElementTree as ET


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    root = ET.parse(path).getroot()
    binaries, tests = [], []
    for suite in root.iter("testsuite"):
        cases = list(suite.iter("testcase"))
        total = sum(float(c.get("time", 0)) for c in cases)
        binaries.append((total, suite.get("name"), len(cases)))
        for c in cases:
            tests.append((float(c.get("time", 0)), f"{suite.get('name')} {c.get('name')}"))
    binaries.sort(reverse=True)
    tests.sort(reverse=True)
    print(f"slowest test binaries (sum of their tests' seconds), top {n}:")
    for total, name, count in binaries[:n]:
        print(f"  {total:8.1f} s  {count:4d} tests  {name}")
    print(f"slowest tests, top {n}:")
    for t, name in tests[:n]:
        print(f"  {t:8.1f} s  {name}")
    print(f"{len(tests)} tests in {len(binaries)} binaries, {sum(t for t, _ in tests):.0f} test-seconds")


if __name__ == "__main__":
    main()
