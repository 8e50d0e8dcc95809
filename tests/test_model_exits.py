"""Bad input (issue 32, item 5): a model file that tries to end the process, while it is
imported or in ``build()``, by ``SystemExit``, ``sys.exit(0)`` or ``os._exit(0)``, is one
``error:`` line and exit 2 for ``warm``, ``plan`` and ``explain``: never a silent exit 0.

Real processes.
"""

from __future__ import annotations

import pytest
from trust import assert_one_line_error, cli

CASES = {
    "SystemExit at import": ("raise SystemExit(0)\n", r"while it was imported \(sys.exit\(0\)\)"),
    "sys.exit in build": ("import sys\ndef build():\n    sys.exit(0)\n",
                          r"in build\(\) \(sys.exit\(0\)\)"),
    "os._exit at import": ("import os\nos._exit(0)\n", r"while it was imported \(os._exit\(0\)\)"),
    "os._exit in build": ("import os\ndef build():\n    os._exit(0)\n",
                          r"in build\(\) \(os._exit\(0\)\)"),
    "_exit imported by name": ("from os import _exit\n_exit(0)\n",
                               r"while it was imported \(os._exit\(0\)\)"),
    "posix._exit in build": ("import posix\ndef build():\n    posix._exit(3)\n",
                             r"in build\(\) \(os._exit\(3\)\)"),
}
#: Each case through one of the commands that read a model file, in turn.
COMMANDS = ("warm", "plan", "explain")


@pytest.mark.parametrize(("case", "command"), [
    (case, COMMANDS[i % len(COMMANDS)]) for i, case in enumerate(CASES)])
def test_a_model_file_that_ends_the_process_is_one_error_line_and_exit_2(tmp_path, case,
                                                                          command):
    source, said = CASES[case]
    path = tmp_path / "model.py"
    path.write_text(source)
    proc = cli("--cache-dir", str(tmp_path / "store"), command, str(path))
    line = assert_one_line_error(proc, 2, said)
    assert f"{path}:" in line  # names the file and its line
