"""``--help`` text for the subcommands: module docstrings as plain text, defaults shown."""
import argparse
import re

_ROLE = re.compile(r":[\w:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")   # :class:`x.Y` -> x.Y
_LITERAL = re.compile(r"``([^`]+)``")                        # ``code`` -> code


def plain(text):
    """``text`` (reStructuredText of a docstring) with roles and literals as plain words,
    and ``::`` at the end of a line as ``:``."""
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.M)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its line breaks kept); every option's default after its
    help, except where the help names it already, the default is None or False, or the
    option is a flag (``--no-train``: its default is not giving it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.nargs == 0  # a flag: its default is its absence
                or any(action.default is x for x in (None, False, argparse.SUPPRESS))):
            return text
        return super()._get_help_string(action)
