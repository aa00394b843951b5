"""The ``ckptio`` command line run inside the test's process, as ``subprocess.run`` would report it.

An interpreter that imports torch costs seconds on this machine; most CLI tests are about what a command prints and
returns, which ``ckptio.cli.main`` gives the same in-process. Tests about the installed console script itself (its
entry point, a real terminal, a process killed mid-command) keep running the executable.

Anything other than the CLI's own clean exit (an exception, a traceback) escapes and fails the test, as it would
show as a traceback in a real run. An ``argparse`` usage error exits with 2, as the executable does.
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def ckptio_here(*args: str) -> subprocess.CompletedProcess:
    from ckptio.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse: a usage error (2) or --help (0)
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
