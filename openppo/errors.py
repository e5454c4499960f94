"""The exception types entry points treat specially: user mistakes, and failures of a run's components.

A `UserError` is raised for anything the user can fix (a bad flag value, a missing file, a key absent from the
data). Entry points catch it and print its message as a single line, then exit with status 2, so the message
must name the flag or file at fault and the fix. Internal invariants use `assert`, never this class.

A `RunFailure` is a component of a distributed run that raised, died or hung (a rank of a worker group, a vLLM
engine). Its message is the whole diagnosis: which actor, what happened, its last log lines. Entry points print
it without a driver traceback (which would only show where the driver was waiting) and exit with status 1.
"""


class UserError(ValueError):
    """A mistake in the user's input: the message names the flag or file and says how to fix it."""


def require(condition: bool, message: str) -> None:
    """Raise `UserError(message)` unless `condition` holds."""
    if not condition:
        raise UserError(message)


class RunFailure(RuntimeError):
    """A rank or an engine of the run raised, died or hung; the message names it and shows its last log lines."""


def headline(error: BaseException | str, default: str = "no details") -> str:
    """The first line of an error's message, without the colon that introduces the details below it (`default`
    when the message is empty): what a one-line warning or report quotes of a longer diagnosis."""
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(":").rstrip() if lines else default
