#!/usr/bin/env python3
"""The results files in docs/results: check them, index them, and generate PERFORMANCE.md's tables.

    python bench/results.py validate [FILE ...]     # every file follows the schema (default:
                                                    # docs/results/*.json); exit 1 if not
    python bench/results.py index [--write]         # docs/results/README.md from the files
    python bench/results.py tables [--write|--check]  # docs/PERFORMANCE.md's tables from the files

The schema is bench/benchlib/results.py's; the tables are bench/benchlib/tables.py's. After adding
or changing a file, run ``index --write`` and ``tables --write`` (tests/test_bench_base.py fails
while either is stale).
"""
import argparse
import glob
import json
import os
import sys

from benchlib import results, tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
PERFORMANCE = os.path.join(ROOT, "docs", "PERFORMANCE.md")


def validate(paths):
    bad = 0
    for path in paths or sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        try:
            with open(path) as f:
                found = results.problems(json.load(f))
        except (OSError, ValueError) as e:
            found = [f"unreadable: {e}"]
        for problem in found:
            print(f"{path}: {problem}")
        bad += bool(found)
    return 1 if bad else 0


def _update(path, new, write, check):
    with open(path) as f:
        old = f.read()
    if write:
        if new != old:
            with open(path, "w") as f:
                f.write(new)
        print(f"{path}: {'updated' if new != old else 'up to date'}")
        return 0
    if check:
        print(f"{path}: {'up to date' if new == old else 'STALE: run with --write'}")
        return 0 if new == old else 1
    print(new)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check files against the schema")
    v.add_argument("files", nargs="*")
    for name, what in (("index", "docs/results/README.md"), ("tables", "docs/PERFORMANCE.md")):
        p = sub.add_parser(name, help=f"generate {what}")
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--write", action="store_true", help=f"rewrite {what}")
        mode.add_argument("--check", action="store_true", help="exit 1 if it is stale")
    a = ap.parse_args(argv)
    if a.command == "validate":
        return validate(a.files)
    if a.command == "index":
        return _update(os.path.join(RESULTS, "README.md"), tables.index_markdown(RESULTS),
                       a.write, a.check)
    with open(PERFORMANCE) as f:
        doc = f.read()
    return _update(PERFORMANCE, tables.render(doc, RESULTS), a.write, a.check)


if __name__ == "__main__":
    sys.exit(main())
