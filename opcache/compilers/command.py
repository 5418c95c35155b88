"""Any other operator compiler, described by a command template.

The template is split like a shell line, then each word is filled in:
``{source}`` (the first source's path), ``{sources}`` (every source, one word
each), ``{workdir}`` (where artifacts must go), ``{soc_version}``,
``{kernel_name}``, ``{op_type}`` and ``{param}`` (a JSON file with the
request's inputs, outputs, attrs and options).
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError
from ..key import digest
from ..keyed_env import COMMAND_KEY_ENVIRONMENT
from ..request import OpRequest
from ..storage.entry import READS_CHECKED
from . import traced
from .toolchain import environment_key, file_identity, kernel_name, tool_changed, which

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from ..readset import ReadSet

FIELDS = ("source", "sources", "workdir", "soc_version", "kernel_name", "op_type", "param")


class CommandCompiler:
    """Runs a user-supplied command; ``fingerprint`` names the toolchain's version.

    ``fingerprint`` is a string the user chooses (a version, say); the
    template itself, the identity of the executable it runs and the variables
    of ``COMMAND_KEY_ENVIRONMENT`` (and ``OPCACHE_KEY_ENV``'s) are added to it.
    """

    name = "command"

    def __init__(
        self,
        template: str,
        *,
        fingerprint: str = "",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        try:
            words = shlex.split(template)
        except ValueError as e:
            raise ConfigError(f"command: template {template!r} cannot be split: {e}") from None
        if not words:
            raise ConfigError("command: the template is empty")
        for word in words:
            try:
                word.format(**dict.fromkeys(FIELDS, ""))
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(
                    f"command: template word {word!r} is not valid ({e}); "
                    f"fields: {', '.join(FIELDS)}"
                ) from None
        executable = which(words[0], env)
        if executable is None:
            raise ConfigError(f"command: {words[0]!r} is not an executable on PATH")
        self.words = words
        self.executable = executable
        self._user_fingerprint = fingerprint
        self._environ = dict(env)
        self._fingerprint: str | None = None

    @classmethod
    def usable(cls, environ: Mapping[str, str]) -> tuple[bool, str]:
        return True, "needs a template: get_compiler('command', template='...')"

    checks_its_tools = True  # (KeyFlow asks the fingerprint at every compile)

    def fingerprint(self) -> str:
        changed = tool_changed(self, self.executable)  # (first: it notes it the first time)
        if self._fingerprint is None or changed:
            self._fingerprint = "|".join(
                [
                    self._user_fingerprint,
                    file_identity(self.executable),
                    digest(" ".join(self.words).encode()),
                    environment_key(self._environ, COMMAND_KEY_ENVIRONMENT),
                    READS_CHECKED,
                ]
            )
        return self._fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> str | ReadSet:
        """Run the template in a folder of the request's sources, traced: what it read
        beyond them (headers through ``-I``, files a variable names), which every hit
        checks; or why its output must not be stored (``traced.run``)."""
        workdir = Path(os.path.abspath(workdir))  # the tool runs in another folder
        with tempfile.TemporaryDirectory(prefix="opcache-cmd-") as src:
            paths = []
            for name, data in request.source_bytes.items():
                Path(src, name).write_bytes(data)
                paths.append(str(Path(src, name)))
            param = Path(src, ".opcache_param.json")
            param.write_text(
                json.dumps(
                    {
                        "op_type": request.op_type,
                        "inputs": list(request.inputs),
                        "outputs": list(request.outputs),
                        "attrs": dict(request.attrs),
                        "options": dict(request.options),
                    },
                    sort_keys=True,
                )
            )
            values = {
                "source": paths[0] if paths else "",
                "workdir": str(workdir),
                "soc_version": request.soc_version,
                "kernel_name": kernel_name(request),
                "op_type": request.op_type,
                "param": str(param),
            }
            argv: list[str] = []
            for word in self.words:
                if word == "{sources}":
                    argv += paths
                else:
                    argv.append(word.format(sources=" ".join(paths), **values))
            argv[0] = self.executable
            return traced.run(
                argv,
                cwd=src,
                workdir=workdir,
                environ=self._environ,
                what=f"{self.words[0]} {request.op_type}",
                tool=self.words[0],
            )
