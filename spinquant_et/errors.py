"""The one exception type the CLI turns into a one-line error message."""


class SpinQuantError(Exception):
    """A user-facing error: the message names the problem and the fix."""
