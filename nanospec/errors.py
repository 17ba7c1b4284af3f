"""The one exception type for input a person got wrong, and the small checks that raise it.

A NanospecError's message names what is wrong (the file or parameter, the value) and how to fix it;
the command line prints it as one line and exits with status 2, without a traceback. Every value
that enters from outside (a file, a parameter) is checked where it enters, so that nothing wrong
reaches torch and fails there, far from its cause."""


import contextvars
import dataclasses
import math
import sys
import warnings


class NanospecError(ValueError):
    pass


COMMAND_LINE = contextvars.ContextVar("nanospec_command_line", default=False)   # set by run_command


def param(python_name: str, flag: str | None = None) -> str:
    """How a message names a parameter: by its Python name to a library caller, by its flag (default
    --the-name) inside a command line's run_command."""
    return (flag or "--" + python_name.replace("_", "-")) if COMMAND_LINE.get() else python_name


def is_int(value) -> bool:
    """An integer, not a bool (True is an int to Python, never a size to a person)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite int or float (not a bool, not NaN, not infinite, not an int too large for a float:
    JSON allows 1 followed by 400 zeros, and math.isfinite raises on it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_int(value, name: str, low: int | None = None, high: int | None = None, fix: str = "") -> int:
    """value, when it is an integer in low..high; otherwise one line naming `name` and the range."""
    if not (is_int(value) and (low is None or value >= low) and (high is None or value <= high)):
        bounds = (f" in {low}..{high}" if low is not None and high is not None
                  else f" >= {low}" if low is not None else f" <= {high}" if high is not None else "")
        raise NanospecError(f"{name} must be an integer{bounds}, {got(value)}{'; ' + fix if fix else ''}")
    return value


def check_real(value, name: str, low: float | None = None, above: float | None = None, fix: str = "",
               high: float | None = None) -> float:
    """value, when it is a finite number >= low (or > above) and <= high; otherwise one line naming `name`."""
    if not (is_real(value) and (low is None or value >= low) and (above is None or value > above)
            and (high is None or value <= high)):
        bound = (f" in [{low}, {high}]" if low is not None and high is not None
                 else f" >= {low}" if low is not None else f" > {above}" if above is not None
                 else f" <= {high}" if high is not None else "")
        raise NanospecError(f"{name} must be a finite number{bound}, {got(value)}{'; ' + fix if fix else ''}")
    return value


def check_bool(value, name: str) -> bool:
    """value, when it is True or False; otherwise one line naming `name`."""
    if not isinstance(value, bool):
        raise NanospecError(f"{name} must be True or False, got {shown(value)}")
    return value


def check_fields(record, checks: dict) -> None:
    """Check the fields of a dataclass `record` that `checks` names, each by its check (check_int,
    check_real or check_bool, bounds given by functools.partial), in order; the message names the field by
    param(). A field whose default is None may be left unset."""
    optional = {field.name for field in dataclasses.fields(record) if field.default is None}
    for name, check in checks.items():
        value = getattr(record, name)
        if value is not None or name not in optional:
            check(value, param(name))


MAX_SHOWN = 80   # characters of a refused value that a message quotes


def shown(value, limit: int = MAX_SHOWN, quote: bool = True) -> str:
    """How a message quotes a value: its repr (the text itself with quote=False), cut to `limit`
    characters. A refused value can be megabytes of JSON, or an integer too long for repr."""
    try:
        text = repr(value) if quote else str(value)
    except ValueError:   # an int past sys.get_int_max_str_digits()
        text = f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def got(value) -> str:
    return "but it is missing" if value is None else f"got {shown(value)}"


def run_command(body) -> int:
    """Run a command-line entry point's body: 0 when it returns, 2 with the error's one line on
    stderr, 130 on Ctrl-C. Warnings print as one line too ("warning: ..."), not as a file, a line
    and its source."""
    warnings.formatwarning = lambda message, *rest, **kw: f"warning: {message}\n"
    token = COMMAND_LINE.set(True)
    try:
        body()
    except NanospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        COMMAND_LINE.reset(token)
    return 0


class NonFiniteLogits(Exception):
    """A step found NaN / inf logits (or K/V): failed holds (request, message) for each request hit."""

    def __init__(self, failed: list):
        super().__init__(failed[0][1])
        self.failed = failed


def non_finite_error(req, flag: int, proposer, what: str = "logits") -> str:
    """flag: 1 where the target's logits (or `what`) for the request held NaN or +inf, 2 the
    drafter's (3 both)."""
    who = "target model" if flag & 1 else "EAGLE head" if getattr(proposer, "head", None) else "draft model"
    return (f"the {who} produced NaN or infinite {what} for request {req.index} at position "
            f"{len(req.tokens)}: its weights hold NaN/inf, its config.json has a broken value (rope_theta, "
            "rms_norm_eps), or float16 overflowed; check the checkpoint, or run in float32 (--dtype float32, "
            "dtype='float32')")
