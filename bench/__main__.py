"""python -m bench [core] [--quick] [--out DIR]

Runs the benchmarks on a real local multi-node Ray cluster made on the spot,
prints a Markdown table and writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", default="core", choices=("core",))
    parser.add_argument("--quick", action="store_true", help="fewer runs and steps (a few minutes)")
    parser.add_argument("--out", default="reports/bench", help="folder for the JSON and Markdown results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from bench import core
    from bench.common import start_cluster

    os.makedirs(args.out, exist_ok=True)
    cluster = start_cluster(2)
    try:
        result = core.run(cluster, quick=args.quick)
    finally:
        cluster.shutdown()
    text = core.table(result)
    print(text)
    with open(os.path.join(args.out, "core.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "core.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
