"""The code blocks of a Markdown page (the user guide's, the README's) as one script, run
with each ``print(...)  # result`` held to what it shows: the docs tests' helpers."""
import re
import sys

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(page, lang):
    """``(first line number, code)`` of each block fenced exactly as ```lang."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2))
            for m in FENCE.finditer(text) if m.group(1).strip() == lang]


def script(page, langs=("python",)):
    """The page's blocks fenced as one of ``langs`` as one script whose line numbers are
    the page's own (every other line blank), so a traceback points at the line of the
    .md file."""
    lines = [""] * (page.read_text().count("\n") + 1)
    for lang in langs:
        for first, code in blocks(page, lang):
            for i, line in enumerate(code.splitlines()):
                lines[first - 1 + i] = line
    return "\n".join(lines) + "\n"


# a shown result: `print(...)  # what it prints` on one line; "..." stands for any text, and
# the comment may go on past the value after ": " or "; " (words about it)
SHOWN = re.compile(r"^\s*print\(.*\)\s+# (.+?)\s*$")


def shown_results(code):
    """``{line number: comment}`` of each line of ``code`` (a page's :func:`script`) that
    prints with its result beside it."""
    return {k: m.group(1) for k, line in enumerate(code.splitlines(), 1)
            for m in [SHOWN.match(line)] if m}


def shows(printed, comment):
    """Whether the comment ``comment`` shows the text ``printed`` ("..." matching any
    text): as the text or its start (an error message, a table), or as the text followed
    by words about it (after ": " or "; ")."""
    def pattern(text):
        return ".*?".join(re.escape(part) for part in text.split("..."))

    if re.match(pattern(comment), printed, re.S):
        return True
    return any(re.fullmatch(pattern(comment[:m.start()]), printed, re.S)
               for m in re.finditer(r"[:;] ", comment))


def run_and_check(page, langs=("python",)):
    """Run ``page``'s blocks of ``langs`` as one script (:func:`script`); each
    ``print(...)  # result`` must print what its comment shows (:func:`shows`)."""
    code = script(page, langs)
    printed = {}

    def recorded(*args, sep=" ", end="\n", file=None, flush=False):
        frame = sys._getframe(1)
        if file is None and frame.f_code.co_filename == str(page):
            printed.setdefault(frame.f_lineno, []).append(sep.join(map(str, args)))
        print(*args, sep=sep, end=end, file=file, flush=flush)

    exec(compile(code, str(page), "exec"), {"__name__": "__main__", "print": recorded})
    wrong = [f"{page.name}:{line}: shows {comment!r}, printed {printed.get(line)!r}"
             for line, comment in shown_results(code).items()
             if not printed.get(line) or not all(shows(p, comment) for p in printed[line])]
    assert not wrong, "\n".join(wrong)
