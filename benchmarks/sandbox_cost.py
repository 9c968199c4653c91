"""What one graded code job costs: CPU-seconds (the sandbox's processes, `RUSAGE_CHILDREN`) and wall seconds per
`envs/grading.py` `graded()` run, for a stdin/stdout ("io") job and an asserts job of `--tests` tests each, the
program correct (every test runs to the end).

    after        graded() of this tree: the harness started `-I -S` (stdlib only, no site-packages), io programs
                 forked per input from one clean interpreter that compiled them once
    before       the harness of `--baseline` (default fe229af, `git show`), run as that commit ran it: `-s` (site
                 imported), one fresh interpreter per io input
    before_IS    that old harness started `-I -S`: what the start-up flags alone buy

Jobs of the three paths alternate (one of each in turn), so load shifts hit them alike; each number is the median
over `--jobs` jobs. The quickstart's code domain grades io jobs of 3 inputs (envs/code.py).

    python benchmarks/sandbox_cost.py              # 40 jobs per path and kind
    python benchmarks/sandbox_cost.py --quick      # 8

The last line is one JSON object: per kind and path {cpu_s, wall_s} (medians), the after/before ratios, the
machine, the load and the commits compared.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd_sao.envs.grading import graded, sandbox_mode
from opd_sao.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=60.0, cpu_s=2)  # a wall limit load cannot reach: every job runs to its end


def jobs(tests: int) -> dict[str, dict]:
    """A correct program per kind, the io one as the quickstart's code env writes it."""
    inputs = [str(x) for x in range(3, 3 + tests)]
    return {"io": {"kind": "io", "source": "x = int(input())\nprint(3*(x+1))\n", "inputs": inputs,
                   "expected": [str(3 * (int(x) + 1)) for x in inputs]},
            "asserts": {"kind": "asserts", "source": "def f(x):\n    return x + 1\n",
                        "tests": [f"assert f({i}) == {i + 1}" for i in range(tests)]}}


def old_graded(harness: str, site: bool, job: dict, n: int, mode: str) -> int:
    """The baseline harness run the way its commit ran it; returns the tests passed (the nonce line's)."""
    nonce = secrets.token_hex(16)
    result = run_python(harness, stdin=json.dumps({"nonce": nonce, **job}), limits=LIMITS, mode=mode,
                        stdlib_only=not site)
    line = next(line for line in result.stdout.splitlines() if line.startswith(f"{nonce} "))
    return json.loads(line[len(nonce) + 1:])["passed"].count("1")


def measured(run) -> tuple[float, float]:
    """(children CPU-s, wall s) of one call."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per path and kind (default 40, --quick 8)")
    parser.add_argument("--tests", type=int, default=3)
    parser.add_argument("--baseline", default="fe229af", help="the commit whose grading harness is 'before'")
    parser.add_argument("--allow-rlimit-only", action="store_true")
    args = parser.parse_args()
    count = args.jobs or (8 if args.quick else 40)
    mode = sandbox_mode(args.allow_rlimit_only)
    old = subprocess.run(["git", "show", f"{args.baseline}:envs/grading_harness.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    paths = {"after": lambda job: graded(job, args.tests, LIMITS, mode)[0][0],
             "before": lambda job: old_graded(old, True, job, args.tests, mode),
             "before_IS": lambda job: old_graded(old, False, job, args.tests, mode)}
    results = {}
    for kind, job in jobs(args.tests).items():
        samples: dict[str, list] = {path: [] for path in paths}
        for _ in range(count + 1):  # the first round warms the page cache and the sandbox probe
            for path, run in paths.items():
                passed = []
                samples[path].append(measured(lambda: passed.append(run(job))))
                if passed != [args.tests]:
                    raise SystemExit(f"{kind} {path}: {passed[0]} of {args.tests} tests passed, want all")
        results[kind] = {path: {"cpu_s": round(statistics.median(c for c, _ in runs[1:]), 4),
                                "wall_s": round(statistics.median(w for _, w in runs[1:]), 4)}
                         for path, runs in samples.items()}
        for path in ("before", "before_IS"):
            results[kind][f"cpu_after_over_{path}"] = round(results[kind]["after"]["cpu_s"]
                                                            / results[kind][path]["cpu_s"], 3)
        print(kind, json.dumps(results[kind]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(json.dumps({"jobs": count, "tests": args.tests, "mode": mode, **results, "baseline": args.baseline,
                      "commit": commit.stdout.strip(), "machine": {
                          "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_1min": os.getloadavg()[0]}}))


if __name__ == "__main__":
    main()
