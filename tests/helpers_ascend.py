"""Stand-ins for CANN's device compilers (bisheng, ccec) and a CMake + Ninja kernel project.

A stand-in is a small compiled program (not a script: opcache's masquerade
passes scripts named like a C compiler over) that takes an Ascend command
line, translates the Ascend flags away and runs a real compiler, clang or
g++, so preprocessing, include search and dependency files are real:

- ``-x cce``, ``-xcce``, ``-x asc``, ``-xasc``, ``--asc-aicore-lang``: C++;
- ``--cce-*``, ``--npu-arch=``, ``--enable-simt`` and
  ``-mllvm <opt>`` pairs are dropped, and written into the object instead:
  each kernel holds ``ASCEND_FLAGS``, the text of them all, so another arch or
  another ``-mllvm`` value makes another object, as with the real compiler;
  ``--cce-aicore-arch=dav-c220-cube`` also defines ``__DAV_C220_CUBE__`` and
  ``--npu-arch=dav-2201`` defines ``__NPU_ARCH__=2201``, which CANN's headers test;
- with ``ASCEND_HOME_PATH`` set, its ``include`` folder is searched after the
  command line's (``-isystem``): a driver that finds the toolkit's headers
  itself, which opcache keys defensively (no public source says bisheng does).

The flags are those of CANN's public build files: asc-devkit's
``cmake/asc/asc_modules/CMakeASCInformation.cmake`` and the bisheng and ccec
lines of its kernel builds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

STAND_IN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char flags[16384];

static void note(const char *arg) {
    if (strlen(flags) + strlen(arg) + 2 >= sizeof flags) exit(99);
    if (flags[0]) strcat(flags, " ");
    strcat(flags, arg);
}

static char *macro(const char *prefix, const char *value, const char *suffix) {
    char *out = malloc(strlen(prefix) + strlen(value) + strlen(suffix) + 1);
    char *p;
    sprintf(out, "%s%s%s", prefix, value, suffix);
    for (p = out + strlen(prefix); *p && p < out + strlen(prefix) + strlen(value); p++)
        *p = *p == '-' ? '_' : (*p >= 'a' && *p <= 'z') ? *p - 32 : *p;
    return out;
}

int main(int argc, char **argv) {
    char **out = calloc(2 * argc + 8, sizeof *out);
    int n = 0, i;
    out[n++] = REAL;
    for (i = 1; i < argc; i++) {
        char *a = argv[i];
        if (!strcmp(a, "-x") && i + 1 < argc
            && (!strcmp(argv[i + 1], "cce") || !strcmp(argv[i + 1], "asc"))) {
            out[n++] = "-x";
            out[n++] = "c++";
            i++;
        } else if (!strcmp(a, "-xcce") || !strcmp(a, "-xasc")) {
            out[n++] = "-xc++";
        } else if (!strcmp(a, "-mllvm") && i + 1 < argc) {
            note(a);
            note(argv[++i]);
        } else if (!strncmp(a, "--cce-aicore-arch=", 18)) {
            note(a);
            out[n++] = macro("-D__", a + 18, "__");
        } else if (!strncmp(a, "--npu-arch=dav-", 15)) {
            note(a);
            out[n++] = macro("-D__NPU_ARCH__=", a + 15, "");
        } else if (!strcmp(a, "--asc-aicore-lang")) {
            note(a);
            out[n++] = "-x";
            out[n++] = "c++";
        } else if (!strncmp(a, "--cce-", 6) || !strncmp(a, "--npu-arch=", 11)
                   || !strcmp(a, "--enable-simt")) {
            note(a);
        } else {
            out[n++] = a;
        }
    }
    if (getenv("ASCEND_HOME_PATH")) {
        char *inc = malloc(strlen(getenv("ASCEND_HOME_PATH")) + 9);
        sprintf(inc, "%s/include", getenv("ASCEND_HOME_PATH"));
        out[n++] = "-isystem";
        out[n++] = inc;
    }
    {
        static char define[16500];
        snprintf(define, sizeof define, "-DASCEND_FLAGS=\"%s\"", flags);
        out[n++] = define;
    }
    out[n] = NULL;
    execv(out[0], out);
    perror(REAL);
    return 127;
}
"""


def real_compiler(kind: str) -> str | None:
    """The compiler a stand-in runs: clang for bisheng, g++ for ccec (None: not here)."""
    return shutil.which("clang++" if kind == "bisheng" else "g++")


def make_stand_in(folder: Path, name: str, real: str) -> Path:
    """Build a stand-in compiler named ``name`` in ``folder`` that runs ``real``."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f".{name}.c"
    source.write_text(STAND_IN)
    exe = folder / name
    gcc = shutil.which("gcc") or "cc"
    subprocess.run(
        [gcc, "-O1", f'-DREAL="{real}"', str(source), "-o", str(exe)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source.unlink()
    return exe


# -- a CMake + Ninja kernel project ----------------------------------------------

# The compile flags of an Ascend C kernel build (ascendc kernel lines, CANN's
# public ops repositories): language, core, sync, stack sizes, standard.
ASCEND_FLAGS = [
    "-xcce",
    "--cce-aicore-arch=dav-c220-vec",
    "--cce-aicore-only",
    "--cce-auto-sync",
    "-mllvm",
    "-cce-aicore-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-function-stack-size=0x8000",
    "-std=c++17",
    "-DTILING_KEY_VAR=0",
]

COMMON_H = """\
#pragma once
#include "tiling.h"
#ifndef ASCEND_FLAGS
#define ASCEND_FLAGS ""
#endif
/* The flags the device compiler was given, kept in every kernel's object. */
__attribute__((used)) static const char ascend_flags[] = ASCEND_FLAGS;
"""
TILING_H = """\
#pragma once
#define TILE 64
"""
VECTOR_H = """\
#pragma once
#include "common.h"
static inline float scale(float x) { return x * 2.0f; }
"""
KERNEL = """\
#include "{header}"
extern "C" void kernel_{i}(const float *in, float *out, int n) {{
    for (int i = 0; i < n && i < TILE; i++) out[i] = {body};
}}
"""
ASC_LANGUAGE = {
    # A minimal ASC language for CMake, shaped as asc-devkit's: a launcher
    # prefix, then bisheng with -std, the flags, -o, -c --asc-aicore-lang <src>.
    "CMakeDetermineASCCompiler.cmake": """\
find_program(CMAKE_ASC_COMPILER NAMES bisheng REQUIRED)
set(CMAKE_ASC_SOURCE_FILE_EXTENSIONS asc)
set(CMAKE_ASC_COMPILER_ENV_VAR "ASC")
configure_file(${CMAKE_CURRENT_LIST_DIR}/CMakeASCCompiler.cmake.in
    ${CMAKE_PLATFORM_INFO_DIR}/CMakeASCCompiler.cmake @ONLY)
""",
    "CMakeASCCompiler.cmake.in": """\
set(CMAKE_ASC_COMPILER "@CMAKE_ASC_COMPILER@")
set(CMAKE_ASC_COMPILER_LOADED 1)
set(CMAKE_ASC_SOURCE_FILE_EXTENSIONS asc)
set(CMAKE_ASC_OUTPUT_EXTENSION .o)
set(CMAKE_ASC_COMPILER_ENV_VAR "ASC")
""",
    "CMakeTestASCCompiler.cmake": 'set(CMAKE_ASC_COMPILER_WORKS 1 CACHE INTERNAL "")\n',
    "CMakeASCInformation.cmake": """\
set(CMAKE_ASC_OUTPUT_EXTENSION .o)
set(CMAKE_INCLUDE_FLAG_ASC "-I")
set(_ASC_LAUNCHER "")
if(CMAKE_ASC_COMPILER_LAUNCHER)
    string(JOIN " " _ASC_LAUNCHER ${CMAKE_ASC_COMPILER_LAUNCHER})
endif()
set(CMAKE_DEPFILE_FLAGS_ASC "-MD -MT <DEP_TARGET> -MF <DEP_FILE>")
set(CMAKE_ASC_DEPFILE_FORMAT gcc)
set(CMAKE_ASC_COMPILE_OBJECT "${_ASC_LAUNCHER} <CMAKE_ASC_COMPILER> <DEFINES> <INCLUDES> \
-std=c++17 <FLAGS> --npu-arch=dav-2201 -o <OBJECT> -c --asc-aicore-lang <SOURCE>")
set(CMAKE_ASC_ARCHIVE_CREATE "<CMAKE_AR> qc <TARGET> <OBJECTS>")
set(CMAKE_ASC_ARCHIVE_FINISH "<CMAKE_RANLIB> <TARGET>")
set(CMAKE_ASC_INFORMATION_LOADED 1)
""",
}


def write_project(root: Path, kernels: int = 20) -> dict[str, list[str]]:
    """A CMake project: ``kernels`` bisheng kernels (.cpp through CMAKE_CXX_COMPILER, with
    the Ascend flags), four ASC kernels (.asc), two C host files; shared headers.

    Returns, per header, the object files of the sources that include it.
    """
    inc = root / "include"
    inc.mkdir(parents=True, exist_ok=True)
    (inc / "common.h").write_text(COMMON_H)
    (inc / "tiling.h").write_text(TILING_H)
    (inc / "vector.h").write_text(VECTOR_H)
    (root / "cmake").mkdir(exist_ok=True)
    for name, text in ASC_LANGUAGE.items():
        (root / "cmake" / name).write_text(text)
    src = root / "src"
    src.mkdir(exist_ok=True)
    includers: dict[str, list[str]] = {"common.h": [], "tiling.h": [], "vector.h": []}
    for i in range(kernels):
        header = "vector.h" if i % 2 else "common.h"
        body = "scale(in[i])" if i % 2 else f"in[i] + {i}.0f"
        (src / f"k{i:02d}.cpp").write_text(KERNEL.format(header=header, i=i, body=body))
        obj = f"CMakeFiles/kernels.dir/src/k{i:02d}.cpp.o"
        includers["common.h"].append(obj)
        includers["tiling.h"].append(obj)
        if i % 2:
            includers["vector.h"].append(obj)
    for i in range(4):
        text = KERNEL.format(header="common.h", i=100 + i, body="in[i]")
        (src / f"a{i}.asc").write_text(text)
        obj = f"CMakeFiles/asc_kernels.dir/src/a{i}.asc.o"
        includers["common.h"].append(obj)
        includers["tiling.h"].append(obj)
    for i in range(2):
        (src / f"host{i}.c").write_text(
            f'#include "tiling.h"\nint host_{i}(void) {{ return TILE + {i}; }}\n'
        )
        includers["tiling.h"].append(f"CMakeFiles/host.dir/src/host{i}.c.o")
    (root / "CMakeLists.txt").write_text(
        f"""\
cmake_minimum_required(VERSION 3.20)
project(kernels LANGUAGES C CXX)
list(APPEND CMAKE_MODULE_PATH ${{CMAKE_SOURCE_DIR}}/cmake)
enable_language(ASC)
include_directories(include)
add_library(kernels STATIC {" ".join(f"src/k{i:02d}.cpp" for i in range(kernels))})
target_compile_options(kernels PRIVATE {_cmake_options(ASCEND_FLAGS)})
add_library(asc_kernels STATIC {" ".join(f"src/a{i}.asc" for i in range(4))})
target_compile_options(asc_kernels PRIVATE -O2 --cce-auto-sync)
add_library(host STATIC src/host0.c src/host1.c)
"""
    )
    return includers


def _cmake_options(flags: list[str]) -> str:
    """``flags`` for target_compile_options: ``-mllvm`` pairs as ``SHELL:`` groups,
    which CMake keeps whole (it drops a repeated ``-mllvm`` otherwise)."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "-mllvm":
            out.append(f'"SHELL:-mllvm {flags[i + 1]}"')
            i += 2
        else:
            out.append(flags[i])
            i += 1
    return " ".join(out)


def cmake_available() -> str | None:
    """Why the CMake tests cannot run here (None: they can)."""
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install cmake ninja-build)"
    if real_compiler("bisheng") is None:
        return "clang is not installed (Debian: apt-get install clang)"
    return None


def environ_without_caches() -> dict[str, str]:
    """The test's environment with no compiler cache settings inherited."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPCACHE_", "CCACHE_", "ASCEND_", "ACL_"))
    }
