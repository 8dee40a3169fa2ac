"""How a command line of ocformer reports a refusal: one line on stderr, then its exit
code.

The line reads as argparse's own errors do (``PROG: error: MESSAGE``), so a bad option
and a bad configuration look alike to a user and to whatever reads the process's last
line (the sweep records it as a point's error). Every ``main(argv)`` of the package
reports through :func:`fail`.
"""

import sys


def fail(program: str | None, code: int, message: str) -> int:
    """Print ``program: error: message`` (``error: message`` without a program) on
    stderr and return ``code``, for ``main`` to return as the exit status.

    Args:
        program: the command, as its usage line names it (``"ocformer.train"``), or
            ``None``.
        code: the exit status (2 for bad input, as argparse; see
            ``ocformer.training.ExitCode``).
        message: what was refused and why, on one line.

    Returns:
        ``code``.
    """
    prefix = "error" if program is None else f"{program}: error"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    return code
