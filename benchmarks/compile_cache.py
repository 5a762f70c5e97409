"""The persistent compilation cache on the library's programs: which programs it stores, that
each one loads back and computes the same bits, and what it saves at start-up.

Runs `v4kv demo` (its defaults: the CacheManager's prefill and decode step programs, then the
Engine with the demo decoder: its step program, prefix hits, snapshots, the pool transfers,
streaming) `--rounds` times, each in a fresh process, all sharing one new cache directory
(JAX_COMPILATION_CACHE_DIR) in which every program is written, however fast it compiled
(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0). Round 1 compiles and writes (serializes) every
program; each later round should load (deserialize) every one instead of compiling it.

Reports per round: wall seconds of the process, the programs jax compiled and the ones it
loaded from the cache (jax's own log lines), and whether the demo printed the same output as
round 1 (tokens, oracle deviation, memory reports; lines of seconds and rates removed). Then
per program name: cache entries and bytes. A process that dies (for example of a fatal signal
while serializing) is reported with its return code and the end of its stderr.

    python benchmarks/compile_cache.py               # 3 rounds; writes results/compile_cache.json
    python benchmarks/compile_cache.py --rounds 10
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from measure import write_result  # noqa: E402

_MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
# Lines whose numbers are times or rates, and the CLI's lines on compiling and on the cache:
# left out of the comparison between rounds.
_TIMED = re.compile(r"tokens/s|ms/step| s first| s \(|seconds|\d s\b|compil|loading the")


def run_round(cache_dir: str) -> dict:
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="true",
               JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_EXPLAIN_CACHE_MISSES="true", JAX_LOG_COMPILES="true", JAX_PLATFORMS="cpu")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "v4kv_jax.cli", "demo"], env=env,
                          capture_output=True, text=True, timeout=1200)
    seconds = time.monotonic() - start
    return {
        "returncode": proc.returncode,
        "seconds": round(seconds, 2),
        "compiled": _MISS.findall(proc.stderr),
        "loaded": _HIT.findall(proc.stderr),
        "output": [line for line in proc.stdout.splitlines() if not _TIMED.search(line)],
        "stderr_tail": proc.stderr[-3000:] if proc.returncode else "",
    }


def entries(cache_dir: str) -> dict[str, dict]:
    by_name: dict[str, dict] = collections.defaultdict(lambda: {"entries": 0, "bytes": 0})
    for name in os.listdir(cache_dir):
        if name.endswith("-cache"):
            program = name.rsplit("-", 2)[0]
            by_name[program]["entries"] += 1
            by_name[program]["bytes"] += os.path.getsize(os.path.join(cache_dir, name))
    return dict(sorted(by_name.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="demo processes (default: 3)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "compile_cache.json"))
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f"argument --rounds: expected an integer >= 2; got {args.rounds}")

    rounds = []
    with tempfile.TemporaryDirectory(prefix="v4kv-compile-cache-") as cache_dir:
        print(f"{'round':>5} {'seconds':>8} {'compiled':>9} {'loaded':>7}  output")
        for i in range(args.rounds):
            r = run_round(cache_dir)
            same = "-" if i == 0 else ("same as round 1" if r["output"] == rounds[0]["output"]
                                       else "DIFFERS from round 1")
            if r["returncode"]:
                same = f"process ended with {r['returncode']}:\n{r['stderr_tail']}"
            r["same_output"] = i == 0 or r["output"] == rounds[0]["output"]
            print(f"{i + 1:>5} {r['seconds']:>8.1f} {len(r['compiled']):>9} "
                  f"{len(r['loaded']):>7}  {same}")
            rounds.append(r)
        stored = entries(cache_dir)

    print(f"\n{'program':<44} {'entries':>7} {'KiB':>8}")
    for name, e in stored.items():
        print(f"{name:<44} {e['entries']:>7} {e['bytes'] / 1024:>8.1f}")
    first, later = rounds[0], rounds[1:]
    recompiled = sorted({n for r in later for n in r["compiled"]})
    print(f"\n{sum(e['entries'] for e in stored.values())} programs written in round 1; "
          f"later rounds compiled {recompiled or 'none'}")
    ok = (all(r["returncode"] == 0 and r["same_output"] for r in rounds)
          and not recompiled)
    write_result({"rounds": [{k: v for k, v in r.items() if k != "output"} for r in rounds],
                  "entries": stored, "recompiled_after_round_1": recompiled,
                  "first_round_seconds": first["seconds"], "ok": ok}, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
