"""What gcc and clang say about the files a compile reads, read back.

Shared by ``opcache wrap``'s C plans and the ``cc`` back-end: the make rule
of a dependency list, the include search list ``-v`` prints, the folders of
``-print-search-dirs`` and the specs files they imply, and the assembler
directives that read a file no dependency list names.  Text work on ``re``
alone: a wrap hit imports it.
"""

from __future__ import annotations

import re

# Assembler directives that read a file (in an asm statement): the preprocessor
# does not list it, so its contents are in no key (ccache's rule too).  Found as
# text, in any case (gas takes .INCBIN): the name, standing apart, then a quote
# (a quoted file name, escaped in a C string, or the end of a string holding the
# name alone), or a macro defined as the name alone; kept with the macros: a
# remembered header list carries them.
#
# `#pragma GCC dependency "parse.y"` (clang's `#pragma clang dependency` too, or
# either through _Pragma) compares that file's time with the current file's and
# warns (an error with -Werror); cc -M does not name it.  Found as the words alone,
# wherever they are: through a macro (`_Pragma(#x)`) no pragma is written out.
FILE_DIRECTIVES = {
    ".incbin": "reads a file the key does not hold",
    ".include": "reads a file the key does not hold",
    "#pragma GCC dependency": "compares the time of a file the key does not hold",
    # (-fpreprocessed: gcc loads the precompiled header it names, which cc -M does not)
    "#pragma GCC pch_preprocess": "loads a precompiled header the key does not hold",
    # (clang's -fms-extensions: the header it maps a name to is looked up where the
    # key's lookups do not look)
    "#pragma include_alias": "maps a header's name to one the key does not look up",
}
# The pragmas above, found as their words alone, wherever they are (through a macro,
# _Pragma, no pragma is written out).
_PRAGMA_WORDS = {
    "#pragma GCC pch_preprocess": b"pch_preprocess",
    "#pragma include_alias": b"include_alias",
}
# Assembler directives of a line table: the assembler names the working folder in
# the object's .debug_line for them, with or without -g.
LINE_DIRECTIVES = frozenset({".file", ".loc"})
# An assembler directive in a source, a header or an asm string, as the assembler
# may be given it: not after a letter (a member "cfg.include" is none) unless that
# ends a C escape ("\t.include"), then blanks or C escapes (\t, \x20, \042)
# before what it takes.  .include before a quote, a backslash or a name (a quoted
# name, a macro, a continued line; not a comment's ".include" ending its line, nor
# "`.include` directives" in a doc comment); .file before a number (.file "x.c"
# alone names a symbol, no line table); .loc.  .incbin is found as its word alone,
# anywhere: a macro may give it its name (.incbin DATA).
_AFTER = rb"(?:(?<![a-z_$])|(?<=\\[a-z]))\."
_GAP = rb"(?:[ \t]|\\[a-z0-9]+)*"
_DIRECTIVE = (
    _AFTER + rb"(?:(include)(?![\w$])" + _GAP + rb"(?=[\"\\a-z_])"
    rb"|(file)" + _GAP + rb"[0-9]|(loc)" + _GAP + rb"[0-9])"
)
_PRAGMA_DEPENDENCY = rb"\b(?:GCC|clang)(?:\s|\\\r?\n)+dependency\b"


def directives_in(data: bytes) -> list[str]:
    """The ``FILE_DIRECTIVES`` and ``LINE_DIRECTIVES`` that ``data`` holds."""
    # (no pattern compiled for most files)
    named = {pragma for pragma, word in _PRAGMA_WORDS.items() if word in data}
    if b"dependency" in data and re.search(_PRAGMA_DEPENDENCY, data) is not None:
        named.add("#pragma GCC dependency")
    lowered = data.lower()
    if b"incbin" in lowered:
        named.add(".incbin")
    if b".include" in lowered or b".file" in lowered or b".loc" in lowered:
        for groups in re.findall(_DIRECTIVE, lowered):
            named.update("." + group.decode() for group in groups if group)
    return sorted(named)


def search_list(said: str) -> tuple[list[str], list[str], list[str], bool]:
    """The include search list gcc and clang print with ``-v``: the ``#include "..."``
    folders, then the ``#include <...>`` ones; the folders they left out as
    nonexistent; whether the list was printed at all."""
    quote: list[str] = []
    bracket: list[str] = []
    absent = []
    into = None
    searched = False
    for line in said.splitlines():
        if line.startswith('ignoring nonexistent directory "') and line.endswith('"'):
            absent.append(line[len('ignoring nonexistent directory "') : -1])
        elif line.startswith('#include "..." search starts here:'):
            into = quote
        elif line.startswith("#include <...> search starts here:"):
            into = bracket
        elif line == "End of search list.":
            into = None
            searched = True
        elif into is not None and line.startswith(" "):
            into.append(line.strip().removesuffix(" (framework directory)"))
    return quote, bracket, absent, searched


# gcc's make quoting (libcpp/mkdeps.cc): a space or tab of a name follows a
# backslash, and the backslashes right before it are doubled (2N+1 then a
# space: N of the name and the space; 2N: N that end the name); $ is $$, # is
# \#; other backslashes are as they are; a backslash-newline continues a line.
_MAKE_QUOTING = re.compile(r"(?P<run>\\+)(?P<space>[ \t])|\\(?P<hash>#)|\$(?P<dollar>\$)|\\\n|\s")


def make_prerequisites(rule: str) -> list[str]:
    """The file names after the target of a make rule as ``cc -M`` writes it."""
    target_end = re.search(r":(\s|$)", rule)
    prerequisites = rule[target_end.end() :] if target_end else ""

    def unquote(match: re.Match[str]) -> str:
        if match["run"] is not None:
            run = len(match["run"])
            return "\\" * (run // 2) + (match["space"] if run % 2 else "\0")
        return match["hash"] or match["dollar"] or "\0"  # "\0": between two names

    return [name for name in _MAKE_QUOTING.sub(unquote, prerequisites).split("\0") if name]


def search_dirs(said: str) -> dict[str, str]:
    """What ``cc -print-search-dirs`` printed, by line (``install``, ``programs``,
    ``libraries``)."""
    return dict(line.partition(": ")[::2] for line in said.splitlines())


def search_folders(search_dirs: dict[str, str], kind: str) -> list[str]:
    """The folders of a ``-print-search-dirs`` line (``programs``, ``libraries``), in order."""
    return list(dict.fromkeys(filter(None, search_dirs.get(kind, "").removeprefix("=").split(":"))))


def specs_places(search_dirs: dict[str, str]) -> list[str]:
    """Where gcc looks for a ``specs`` file, which rewrites its command lines.

    gcc's driver looks in its start-file folders (``LIBRARY_PATH``'s first,
    each bare and with ``<machine>/<version>/``, then its own): each folder
    ``-print-search-dirs`` lists, and each with those last parts taken off, is
    taken (more places than gcc looks in: one made there costs a miss, never a
    wrong object).
    """
    # (install: <prefix>/gcc/<machine>/<version>/)
    machine_version = search_dirs.get("install", "").rstrip("/").split("/")[-2:]
    places: dict[str, None] = {}
    for kind in ("libraries", "programs"):
        for folder in search_folders(search_dirs, kind):
            parts = folder.rstrip("/").split("/")
            while True:
                places[("/".join(parts) or ".") + "/specs"] = None
                if not parts or parts[-1] not in machine_version:
                    break
                parts.pop()
    return list(places)
