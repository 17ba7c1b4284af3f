"""The one exception type for input a person got wrong. Its message says what is wrong and how to
fix it; the command line prints it as one line and exits non-zero, without a traceback."""


import sys
import warnings


class NanospecError(ValueError):
    pass


def run_command(body) -> int:
    """Run a command-line entry point's body: 0 when it returns, 2 with the error's one line on
    stderr. Warnings print as one line too ("warning: ..."), not as a file, a line and its source."""
    warnings.formatwarning = lambda message, *rest, **kw: f"warning: {message}\n"
    try:
        body()
    except NanospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
