"""``opcache demo``: real C kernels compiled through the cache twice.

In a temporary folder, a few operators times a few shapes are compiled with the
``cc`` back-end: the first pass misses and compiles, the second hits.  The
table shows both, and the speed-up.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .cache import OpCache
from .compilers.cc import CcCompiler
from .request import OpRequest
from .settings import Settings, resolve_settings

SOC = "Ascend910B1"
SHAPES = ([16, 1024], [64, 4096], [256, 256])
# Elementwise kernels the compiler has real work on: loops it unrolls and vectorises.
KERNELS = {
    "Add": "o[i] = a[i] + b[i];",
    "Mul": "o[i] = a[i] * b[i];",
    "Relu": "o[i] = a[i] > 0 ? a[i] : 0;",
    "Gelu": "o[i] = 0.5f * a[i] * (1 + tanhf(0.7978846f * (a[i] + 0.044715f * a[i]*a[i]*a[i])));",
}
_TEMPLATE = """\
#include <math.h>
#include <stddef.h>
static const size_t shape[IN0_NDIM] = IN0_SHAPE;
void kernel(const float *restrict a, const float *restrict b, float *restrict o) {
    (void)b; (void)shape;
    for (size_t i = 0; i < IN0_SIZE; i++) { BODY }
}
"""


def requests() -> list[OpRequest]:
    """The demo's operators: every kernel at every shape."""
    out = []
    for op_type, body in KERNELS.items():
        source = _TEMPLATE.replace("BODY", body).encode()
        for shape in SHAPES:
            tensor = {"shape": shape, "dtype": "float32", "format": "ND"}
            out.append(
                OpRequest(
                    op_type=op_type,
                    soc_version=SOC,
                    op_name=f"{op_type.lower()}_{'x'.join(map(str, shape))}",
                    inputs=[tensor, tensor],
                    outputs=[tensor],
                    options={"flags": ["-O3"]},
                    sources={f"{op_type.lower()}.c": source},
                )
            )
    return out


def run(
    keep: bool = False,
    out: Callable[[str], None] = print,
    *,
    cache_options: Mapping[str, Any] | None = None,
) -> int:
    """Run the demo, printing through ``out``; returns an exit status.

    ``cache_options`` are ``resolve_settings`` options from the command line;
    the mode defaults to enable and the cache to a folder inside the demo's.
    """
    folder = Path(tempfile.mkdtemp(prefix="opcache-demo-"))
    try:
        options = {k: v for k, v in (cache_options or {}).items() if v not in (None, "")}
        options.setdefault("op_compiler_cache_dir", str(folder / "cache"))
        settings = resolve_settings(**options, default_mode="enable")
        compiler = CcCompiler()
        ops = requests()
        passes = []
        with OpCache(settings) as cache:
            for run_index in (1, 2):
                build = folder / f"build{run_index}"
                started = time.perf_counter()
                results = cache.compile_many(ops, compiler, lambda r, b=build: b / r.op_name)
                passes.append((time.perf_counter() - started, results))
        (first_total, first), (second_total, second) = passes
        failed = [r for r in first + second if r.error is not None]
        if failed:
            out(f"opcache demo: a kernel failed to compile: {failed[0].error}")
            return 1
        out(f"opcache demo: {len(ops)} C kernels compiled twice with {compiler.argv[0]}\n")
        out(f"{'operator':<18} {'first run':>16} {'second run':>16}")
        for req, a, b in zip(ops, first, second, strict=True):
            out(
                f"{req.op_name:<18} {a.status:>5} {a.seconds * 1000:>8.1f} ms {b.status:>5} "
                f"{b.seconds * 1000:>8.1f} ms"
            )
        out(f"{'total':<18} {first_total * 1000:>13.1f} ms {second_total * 1000:>13.1f} ms")
        out(f"\nspeed-up of the second run: {first_total / second_total:.0f}x")
        _say_where_the_cache_is(settings, folder, keep, options["op_compiler_cache_dir"], out)
        return 0
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _say_where_the_cache_is(
    settings: Settings, folder: Path, keep: bool, cache_dir: str, out: Callable[[str], None]
) -> None:
    """The last lines: only point at a cache folder that exists after the demo."""
    if settings.mode == "disable":
        out("\nthe cache was disabled: nothing was stored")
        return
    out(f"\ncache folder: {settings.root}")
    if settings.root.is_relative_to(folder) and not keep:
        out(f"              (removed with {folder}; opcache demo --keep keeps it)")
        return
    if settings.root.is_relative_to(folder):
        out(f"              (kept in {folder})")
    out(f"look at it:   opcache stats --op_compiler_cache_dir {cache_dir}")
