#!/usr/bin/env python3
"""Prints the slowest test binaries and tests of a cargo-nextest JUnit report.

    scripts/slowest-tests.py target/nextest/default/junit.xml [N]

A file's time is the sum of its tests' (nextest runs several at once, so the sum
over files is more than the phase's wall time). A crate's integration tests are one
binary, `it`, with a module per tests/*.rs file: they are grouped by that module.
"""
import sys
import xml.etree.ElementTree as ET


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    root = ET.parse(path).getroot()
    groups, tests = {}, []
    for suite in root.iter("testsuite"):
        for c in suite.iter("testcase"):
            name, t = c.get("name"), float(c.get("time", 0))
            group = suite.get("name")
            if group.endswith("::it") and "::" in name:
                group = f"{group[:-len('it')]}{name.split('::')[0]}"
            total, count = groups.get(group, (0.0, 0))
            groups[group] = (total + t, count + 1)
            tests.append((t, f"{suite.get('name')} {name}"))
    binaries = [(total, name, count) for name, (total, count) in groups.items()]
    binaries.sort(reverse=True)
    tests.sort(reverse=True)
    print(f"slowest test files (sum of their tests' seconds), top {n}:")
    for total, name, count in binaries[:n]:
        print(f"  {total:8.1f} s  {count:4d} tests  {name}")
    print(f"slowest tests, top {n}:")
    for t, name in tests[:n]:
        print(f"  {t:8.1f} s  {name}")
    print(f"{len(tests)} tests in {len(binaries)} files, {sum(t for t, _ in tests):.0f} test-seconds")


if __name__ == "__main__":
    main()
