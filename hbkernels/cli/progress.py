"""A dependency-free progress bar for the command line.

On a terminal it redraws one line in place (at most 10 times a second); when
the stream is not a terminal (a CI log, a pipe) it prints a plain line at every
10 % instead, so logs stay short. ``HBK_PROGRESS=0`` silences it.

>>> import io
>>> out = io.StringIO()
>>> with Progress(4, "steps", stream=out) as bar:
...     for _ in range(4):
...         bar.update(loss="0.5")
>>> out.getvalue().splitlines()[-1].startswith("steps 4/4 100%")
True
"""
import os
import sys
import time


class Progress:
    """``Progress(total, desc, initial=0)``; ``update(n=1, **postfix)`` after each
    unit of work (``initial``: units done before, e.g. by a resumed run). The time
    left is estimated from the units after the first ``warm`` ones (a first step that
    compiles kernels would make it far too long), ``?`` until then."""

    def __init__(self, total, desc="", *, initial=0, stream=None, enabled=True, warm=0):
        self.total = max(int(total), 0)
        self.desc = desc
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and os.environ.get("HBK_PROGRESS", "1") != "0"
        self.tty = self.enabled and getattr(self.stream, "isatty", lambda: False)()
        self.done = self.initial = int(initial)
        self.postfix = ""
        self.start = time.perf_counter()
        self.warm = int(warm)
        self._rate_from = (self.start, self.done) if self.warm <= 0 else None
        self._drawn_at = 0.0
        self._next_tenth = 1

    def update(self, n=1, **postfix):
        self.done += n
        if self._rate_from is None and self.done - self.initial >= self.warm:
            self._rate_from = (time.perf_counter(), self.done)
        if postfix:
            self.postfix = " ".join(f"{k}={v}" for k, v in postfix.items())
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._drawn_at >= 0.1 or self.done >= self.total:
                self._drawn_at = now
                self.stream.write("\r" + self.line(now) + "\x1b[K")
                self.stream.flush()
        elif self.total and self.done * 10 >= self._next_tenth * self.total:
            self._next_tenth = self.done * 10 // self.total + 1
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now=None):
        now = now or time.perf_counter()
        elapsed = now - self.start
        eta = "?"
        if self._rate_from is not None:
            since, base = self._rate_from
            if self.done >= self.total:
                eta = "0.0s"
            elif self.done > base and now > since:
                eta = f"{(self.total - self.done) * (now - since) / (self.done - base):.1f}s"
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(20 * frac)
            text = (f"{self.desc} {self.done}/{self.total} {100 * frac:3.0f}% [{bar:<20}] "
                    f"{elapsed:.1f}s<{eta}")
        else:
            text = f"{self.desc} {self.done} {elapsed:.1f}s"
        return f"{text} {self.postfix}".rstrip()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
