"""The errors of the command line: which are the user's (one line) and how they read."""
from ..errors import BoundsError, CheckpointError, DataError, MissingDependencyError


class CLIError(Exception):
    """An error the user can fix; printed as one line, exit status 1."""


#: exceptions shown as one line (anything else is a bug: full traceback)
USER_ERRORS = (CLIError, OSError, BoundsError, CheckpointError, DataError, MissingDependencyError)


def error_line(exc):
    """One line for a user error: the message (with the exception's type where that helps)."""
    if isinstance(exc, (CLIError, DataError, MissingDependencyError)):
        return str(exc).splitlines()[0]
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
