"""The environment variables that join a tool's key, or change how it is run.

Data only, no imports: ``wrap.py`` (the keys of ``opcache wrap``'s plans)
and ``compilers/cc.py`` (the C compiler's fingerprint and the environment it
runs in) share these lists.  A wrap hit imports it with ``wrap.py``: it
must stay data, costing a hit nothing but its tuples.
"""

# Variables the operator scripts and the tools they run read (CANN's generated
# op .py, asc-devkit's build scripts): where sources, tiling libraries and the
# device compiler are found.  PATH and PYTHONPATH decide which programs and
# modules a lookup finds, so the read set's lookups hold only under the same ones.
OPC_KEY_ENVIRONMENT = (
    "BUILD_KERNEL_SRC", "ASCEND_CUSTOM_OPP_PATH", "ASCEND_OPP_PATH", "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME", "ASCEND_AICPU_PATH", "BISHENG_REAL_PATH", "TILINGKEY_PAR_COMPILE",
    "ASCENDC_SPK_SUB_ID", "BUILD_BUILTIN_OPP", "PATH", "PYTHONPATH", "PYTHONHOME",
    "LD_LIBRARY_PATH", "LD_PRELOAD",
    # read by CANN's own compile Python (asc-devkit's asc_op_compile_base): -g for
    # coverage, the super-kernel transform, hashed temporary names
    "ASCENDC_COV", "SKT_ENABLE", "BIN_FILENAME_HASHED",
)  # fmt: skip
# Variables making opc (CANN's compile Python) write files outside its --output folder:
# a hit could not give them back (ASCENDC_BUILD_LOG_DIR: each kernel's build log).
OPC_SIDE_OUTPUT_ENVIRONMENT = ("ASCENDC_BUILD_LOG_DIR",)
# Variables that move where Python looks for modules (the user site-packages).
# Not in the key: the read set holds what was found there.  They pick which
# remembered read sets are tried, as the working folder does.
OPC_READS_ENVIRONMENT = (
    "HOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR",
)  # fmt: skip
# Paths or globs (os.pathsep between) whose contents join an opc key, and
# variable names (spaces, commas or colons between) whose values join it.
ENV_EXTRA_FILES = "OPCACHE_EXTRA_FILES"
ENV_KEY_ENV = "OPCACHE_KEY_ENV"

# Variables adding folders to a C compile's include search list: the cc
# back-end asks the compiler for its own list without them.
CC_INCLUDE_ENVIRONMENT = (
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "OBJCPLUS_INCLUDE_PATH",
)
# Environment variables that change what a C compile gives: its object, its
# dependency file or its messages (docs/wrap.md, "The environment of a C compile").
CC_KEY_ENVIRONMENT = (
    *CC_INCLUDE_ENVIRONMENT,
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "GCC_COMPARE_DEBUG",
    "CCC_OVERRIDE_OPTIONS",
    "QA_OVERRIDE_GCC3_OPTIONS",
    "SDKROOT",
    "MACOSX_DEPLOYMENT_TARGET",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "GCC_COLORS",
    "GCC_URLS",
    "TERM_URLS",
    "COLUMNS",
    "GCC_EXTRA_DIAGNOSTIC_OUTPUT",
)
# CANN's toolkit roots (set_env.sh sets them all), keyed for its device
# compilers (bisheng, ccec, bishengcc) on top of CC_KEY_ENVIRONMENT: no public
# source says the driver reads them, but a driver that finds the toolkit's
# headers or device libraries through them would make another object.
ASCEND_CC_KEY_ENVIRONMENT = (
    "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "ASCEND_AICPU_PATH",
    "TOOLCHAIN_HOME", "BISHENG_REAL_PATH",
)  # fmt: skip
# Variables that make gcc run its programs (cc1, as, collect2) from folders they
# name: which programs those are is not keyed, so a compile with one set is not cached.
CC_PROGRAM_ENVIRONMENT = ("GCC_EXEC_PREFIX", "COMPILER_PATH")
# Variables by which clang (bisheng too) edits its own command line: the flags they
# add (a profile to use, a plugin) are not screened as the command line's are, so a
# compile with one set is not cached.
CC_ARGUMENT_ENVIRONMENT = ("CCC_OVERRIDE_OPTIONS", "QA_OVERRIDE_GCC3_OPTIONS")
# Variables that make the compiler write a file opcache does not capture.
CC_SIDE_OUTPUT_ENVIRONMENT = (
    "DEPENDENCIES_OUTPUT",
    "SUNPRO_DEPENDENCIES",
    "CC_PRINT_OPTIONS",
    "CC_PRINT_HEADERS",
    "CC_LOG_DIAGNOSTICS",
    "CC_PRINT_PROC_STAT",
)
# A `command` template's tool is anyone's: the variables that pick which programs,
# libraries (to run, and to link: LIBRARY_PATH, LD_RUN_PATH), modules (the user
# site-packages too) and headers it finds, its locale, and those of the compilers
# opcache knows, but for their messages' (strace sees files, not variables:
# others go in OPCACHE_KEY_ENV).
_DIAGNOSTICS_ONLY = frozenset((
    "GCC_COLORS", "GCC_URLS", "TERM_URLS", "COLUMNS", "GCC_EXTRA_DIAGNOSTIC_OUTPUT", "LC_MESSAGES",
))  # fmt: skip
COMMAND_KEY_ENVIRONMENT = tuple(
    name
    for name in dict.fromkeys((
        "SOURCE_DATE_EPOCH", "LIBRARY_PATH", "LD_RUN_PATH", "LC_COLLATE",
        *OPC_READS_ENVIRONMENT, *OPC_KEY_ENVIRONMENT, *CC_KEY_ENVIRONMENT,
        *ASCEND_CC_KEY_ENVIRONMENT,
    ))
    if name not in _DIAGNOSTICS_ONLY
)  # fmt: skip
