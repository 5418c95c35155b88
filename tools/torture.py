#!/usr/bin/env python3
"""Torture harness: many real processes on one cache folder, every result checked.

Workers compile overlapping operator sets in ``enable`` mode (with the real
``cc`` back-end and a fast deterministic test compiler), some start in
``force`` mode now and then, some run with a clock far ahead so every entry
looks old to them.  A cron process runs ``opcache age`` and ``opcache verify``,
``clear`` now and then, and flips bytes in stored artifacts.  The size limit
is tiny, so aging runs all the time.  Every artifact a compile returns is
compared byte for byte with an independent fresh compile of the same request.

It ends with ``torture: N compiles, N hits, 0 wrong, 0 errors, 0 lost`` and
exits 1 if an artifact was wrong, a call raised, an operator could not be
compiled, or the size counters disagree with a full recount.

    python tools/torture.py [--seconds 60] [--procs 6] [--ops 40] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import opcache
from opcache.compilers.cc import CcCompiler
from opcache.key import digest
from opcache.storage.entry import MANIFEST
from opcache.storage.local import LocalStore

SOCS = ("Ascend910B1", "Ascend310P3")
CC_SHARE = 0.25  # of the operators go through the real C compiler


class TestCompiler:
    """Fast and deterministic: bytes derived from the request, sizes 4..256 KB."""

    name = "torture"

    def fingerprint(self) -> str:
        return "torture-1"

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        from opcache.compilers.toolchain import kernel_name

        kernel = kernel_name(request)
        seed = int(digest(kernel.encode())[:8], 16)
        rng = random.Random(seed)
        size = rng.randint(4 * 1024, 256 * 1024)
        (workdir / f"{kernel}.o").write_bytes(rng.randbytes(size))
        (workdir / f"{kernel}.json").write_text(json.dumps({"kernel": kernel, "size": size}))


def operators(count: int) -> list[opcache.OpRequest]:
    ops = []
    for i in range(count):
        soc = SOCS[i % len(SOCS)]
        shape = [1 + i % 7, 16 * (1 + i % 5)]
        tensor = {"shape": shape, "dtype": "float32", "format": "ND"}
        if i < count * CC_SHARE:
            source = f"float k{i}(float x) {{ return x * {i + 1}.0f + IN0_SIZE; }}\n".encode()
            ops.append(
                opcache.OpRequest(
                    op_type=f"CcOp{i}",
                    soc_version=soc,
                    op_name=f"cc_{i}",
                    inputs=[tensor],
                    outputs=[tensor],
                    sources={f"k{i}.c": source},
                )
            )
        else:
            ops.append(
                opcache.OpRequest(
                    op_type=f"Op{i}",
                    soc_version=soc,
                    op_name=f"op_{i}",
                    inputs=[tensor],
                    outputs=[tensor],
                    attrs={"i": i},
                )
            )
    return ops


def _compiler_for(request: opcache.OpRequest, cc: CcCompiler, fake: TestCompiler):
    return cc if request.op_type.startswith("CcOp") else fake


def _reference(request, compiler, memo: dict) -> dict[str, bytes]:
    """An independent fresh compile, without the cache."""
    if request.op_type not in memo:
        with tempfile.TemporaryDirectory() as tmp:
            compiler.compile(request, Path(tmp))
            memo[request.op_type] = {p.name: p.read_bytes() for p in Path(tmp).iterdir()}
    return memo[request.op_type]


def worker(index: int, cache_dir: str, ops_count: int, deadline: float, seed: int, out) -> None:
    # Corrupt entries are expected here (the cron flips bytes): count them, don't print them.
    logging.getLogger("opcache").addHandler(logging.NullHandler())
    rng = random.Random(seed * 1000 + index)
    ops = operators(ops_count)
    # Overlapping sets: each worker uses two thirds of the operators.
    mine = [op for op in ops if rng.random() < 0.67] or ops
    cc, fake = CcCompiler(), TestCompiler()
    memo: dict[str, dict[str, bytes]] = {}
    counts = {"compiles": 0, "hits": 0, "wrong": 0, "errors": 0, "lost": 0, "force": 0}
    problems: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix=f"torture-w{index}-"))
    try:
        while time.time() < deadline:
            mode = "force" if rng.random() < 0.01 else "enable"
            counts["force"] += mode == "force"
            offset = 4000.0 if rng.random() < 0.2 else 0.0
            settings = opcache.resolve_settings(
                op_compiler_cache_mode=mode,
                op_compiler_cache_dir=cache_dir,
                environ={"HOME": cache_dir},
            )
            with opcache.OpCache(
                settings, clock=lambda o=offset: time.time() + o, lock_timeout=30
            ) as cache:
                for _ in range(rng.randint(5, 40)):
                    if time.time() >= deadline:
                        break
                    request = rng.choice(mine)
                    compiler = _compiler_for(request, cc, fake)
                    out_dir = scratch / f"{counts['compiles']}"
                    counts["compiles"] += 1
                    try:
                        result = cache.compile(request, compiler, out_dir)
                    except Exception:
                        counts["errors"] += 1
                        problems.append(traceback.format_exc(limit=3))
                        continue
                    counts["hits"] += result.status == "hit"
                    want = _reference(request, compiler, memo)
                    got = {name: path.read_bytes() for name, path in result.files.items()}
                    if not got:
                        counts["lost"] += 1
                        problems.append(f"{request.op_type}: no artifacts ({result.status})")
                    elif got != want:
                        counts["wrong"] += 1
                        problems.append(f"{request.op_type}: wrong artifacts ({result.status})")
                    shutil.rmtree(out_dir, ignore_errors=True)
    except Exception:
        counts["errors"] += 1
        problems.append(traceback.format_exc(limit=5))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        out.put((counts, problems[:5]))


def cron(cache_dir: str, deadline: float, seed: int, out) -> None:
    rng = random.Random(seed)
    counts = {"age": 0, "verify": 0, "clear": 0, "flips": 0, "cron_failures": 0}
    store = LocalStore(Path(cache_dir) / "kernel_cache")
    cli = [sys.executable, "-m", "opcache"]
    flags = ["--op_compiler_cache_dir", cache_dir]
    env = {**os.environ, "HOME": cache_dir}
    while time.time() < deadline:
        time.sleep(rng.uniform(0.2, 0.8))
        roll = rng.random()
        if roll < 0.45:
            command, name = ["age"], "age"
        elif roll < 0.65:
            command, name = ["verify"], "verify"
        elif roll < 0.72:
            command, name = ["clear", "--soc_version", rng.choice(SOCS)], "clear"
        else:
            counts["flips"] += _flip_a_byte(store, rng)
            continue
        done = subprocess.run([*cli, *command, *flags], env=env, capture_output=True, check=False)
        counts[name] += 1
        if done.returncode != 0:
            counts["cron_failures"] += 1
    out.put((counts, []))


def _flip_a_byte(store: LocalStore, rng: random.Random) -> int:
    """Corrupt one stored artifact in place (same size), as a bad disk would."""
    for _ in range(5):
        soc = rng.choice(SOCS)
        entries = list(store.scan(soc))
        if not entries:
            continue
        entry_dir = store.entry_dir(soc, rng.choice(entries).key)
        try:
            files = [p for p in entry_dir.iterdir() if p.name != MANIFEST]
            if not files:
                continue
            path = rng.choice(files)
            # In place, one byte, as bit rot does: the file never changes size
            # (a rewrite would show a remover a transiently shorter file).
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if not size:
                    continue
                f.seek(rng.randrange(size))
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            return 1
        except OSError:
            continue  # aged or cleared meanwhile
    return 0


def recount_matches(cache_dir: str) -> list[str]:
    """Size counters against a walk of every chip folder, at rest."""
    store = LocalStore(Path(cache_dir) / "kernel_cache")
    problems = []
    for soc in store.chips():
        counted = store.used(soc)
        entries = size = 0
        for info in store.scan(soc):
            entries += 1
            size += sum(
                p.stat().st_size for p in store.entry_dir(soc, info.key).iterdir() if p.is_file()
            )
        if counted != (entries, size):
            problems.append(f"{soc}: counters say {counted}, a recount finds {(entries, size)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--procs", type=int, default=6)
    parser.add_argument("--ops", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", help="cache folder (default: a new temporary one, removed)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    cache_dir = args.dir or tempfile.mkdtemp(prefix="opcache-torture-")
    root = Path(cache_dir) / "kernel_cache"
    root.mkdir(parents=True, exist_ok=True)
    # A tiny limit: aging runs all the time.
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    deadline = time.time() + args.seconds
    procs = [
        ctx.Process(target=worker, args=(i, cache_dir, args.ops, deadline, args.seed, results))
        for i in range(args.procs)
    ]
    procs.append(ctx.Process(target=cron, args=(cache_dir, deadline, args.seed, results)))
    started = time.time()
    for p in procs:
        p.start()
    totals: dict[str, int] = {}
    problems: list[str] = []
    for _ in procs:
        counts, found = results.get(timeout=args.seconds + 600)
        for name, value in counts.items():
            totals[name] = totals.get(name, 0) + value
        problems += found
    for p in procs:
        p.join()
    elapsed = time.time() - started
    problems += recount_matches(cache_dir)
    with opcache.OpCache(
        opcache.resolve_settings(op_compiler_cache_dir=cache_dir, environ={"HOME": cache_dir})
    ) as cache:
        stats = cache.stats()
    if not args.dir:
        shutil.rmtree(cache_dir, ignore_errors=True)

    figures = {
        **totals,
        "seconds": round(elapsed, 1),
        "procs": args.procs,
        "ops": args.ops,
        "corrupt_detected": stats["corrupt"],
        "evicted_entries": stats["evicted_entries"],
        "counter_mismatches": sum("counters say" in p for p in problems),
    }
    print(
        f"torture: {totals.get('compiles', 0)} compiles, {totals.get('hits', 0)} hits, "
        f"{totals.get('wrong', 0)} wrong, {totals.get('errors', 0)} errors, "
        f"{totals.get('lost', 0)} lost"
    )
    print(
        f"  {args.procs} workers + cron for {elapsed:.0f} s; faults: "
        f"{totals.get('force', 0)} force starts, {totals.get('clear', 0)} clears, "
        f"{totals.get('flips', 0)} flipped bytes "
        f"({stats['corrupt']} corrupt entries caught), {totals.get('age', 0)} age and "
        f"{totals.get('verify', 0)} verify runs, {stats['evicted_entries']} entries aged out"
    )
    for problem in problems[:10]:
        print(f"  problem: {problem.strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    bad = (
        totals.get("wrong", 0)
        or totals.get("errors", 0)
        or totals.get("lost", 0)
        or totals.get("cron_failures", 0)
        or figures["counter_mismatches"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
