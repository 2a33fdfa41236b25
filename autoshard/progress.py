"""Progress of long stages on stderr, the one mechanism every command and ``progress=True`` use.

On a terminal a stage shows a spinner while it runs and one line when it ends; anywhere else (a
log file, a pipe, CI) each stage is two plain lines, one when it starts and one when it ends with
its elapsed seconds, so a log says what was running when a job stalled or was killed::

    autoshard: capturing gpt2 on meta tensors ...
    autoshard: capturing gpt2 on meta tensors: done in 2.26 s

A stage that raises ends with ``failed after N s (ErrorType)``. A disabled ``Progress`` only times
the stages (``seconds``), printing nothing.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Iterator

PREFIX = "autoshard: "


class Progress:
    """Times stages (``seconds[key]``) and, if ``enabled``, reports them on ``stream`` (stderr)."""

    def __init__(self, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream
        self.seconds: dict[str, float] = {}

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    def _terminal(self) -> bool:
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    @contextlib.contextmanager
    def stage(self, message: str, key: str | None = None) -> Iterator[None]:
        """Run the body as the stage ``message``; its seconds go to ``seconds[key or message]``."""
        start = time.perf_counter()
        terminal = self.enabled and self._terminal()
        if self.enabled and not terminal:
            self._line(f"{message} ...")
        try:
            if terminal:
                from rich.console import Console
                from rich.markup import escape

                with Console(file=self._out()).status(f"{escape(message)} ..."):
                    yield
            else:
                yield
        except BaseException as e:
            if self.enabled:
                self._line(f"{message}: failed after {time.perf_counter() - start:.2f} s ({type(e).__name__})")
            raise
        finally:
            self.seconds[key or message] = time.perf_counter() - start
        if self.enabled:
            self._line(f"{message}: done in {self.seconds[key or message]:.2f} s")

    def _line(self, text: str) -> None:
        out = self._out()
        out.write(PREFIX + text + "\n")
        out.flush()
