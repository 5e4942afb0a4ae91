"""The errors of the command line: which are the user's (one line) and how they read."""
import argparse
import os

from ..dist import CommError
from ..errors import BoundsError, CapacityError, CheckpointError, DataError, MissingDependencyError


class CLIError(Exception):
    """An error the user can fix; printed as one line, exit status 1."""


#: exceptions shown as one line (anything else is a bug: full traceback)
USER_ERRORS = (CLIError, OSError, BoundsError, CapacityError, CheckpointError, CommError,
               DataError, MissingDependencyError)


def error_line(exc):
    """One line for a user error: the message (with the exception's type where that helps)."""
    if isinstance(exc, (CLIError, DataError, MissingDependencyError)):
        return str(exc).splitlines()[0]
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and exit status 1 (as every other
    user error of the command line)."""

    def error(self, message):
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def usable_dir(path):
    """Make directory ``path`` (and its parents) and write and remove a file in it: a
    CLIError saying why when that fails. Run before any work, so a bad path is found
    then, not when the first result is written."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CLIError(f"cannot make directory {path}: {existing} is a file")
    probe = os.path.join(path, f".hbkernels-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise CLIError(f"cannot write in directory {path}: {e.strerror or type(e).__name__}") from None


def writable_file(path):
    """A CLIError unless a file can be written at ``path`` (its directory exists and
    is writable): checked before any work is done."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"{path} is a directory, not a file")
    if not os.path.isdir(directory):
        raise CLIError(f"cannot write {path}: no directory {directory}")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CLIError(f"cannot write {path}: permission denied")


def writable_dir(path):
    """A CLIError unless directory ``path`` exists and is writable, or can be made."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CLIError(f"cannot make directory {path}: {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise CLIError(f"cannot write in {existing}: permission denied")
