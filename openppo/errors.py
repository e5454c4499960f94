"""The one exception type for user mistakes.

A `UserError` is raised for anything the user can fix (a bad flag value, a missing file, a key absent from the
data). Entry points catch it and print its message as a single line, then exit with status 2, so the message
must name the flag or file at fault and the fix. Internal invariants use `assert`, never this class.
"""


class UserError(ValueError):
    """A mistake in the user's input: the message names the flag or file and says how to fix it."""


def require(condition: bool, message: str) -> None:
    """Raise `UserError(message)` unless `condition` holds."""
    if not condition:
        raise UserError(message)
