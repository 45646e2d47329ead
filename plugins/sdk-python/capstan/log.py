"""Logging to the host's log, tagged with the plugin's name.

Inside the sandbox lines go through the ``capstan:plugin/log`` import; outside it (unit
tests with :mod:`capstan.testing`) they go to a sink the test chooses, stderr by default.
:class:`Handler` plugs the standard ``logging`` module into the same place.
"""

import logging
import sys
from typing import Callable, List, Tuple

TRACE = "trace"
DEBUG = "debug"
INFO = "info"
WARN = "warn"
ERROR = "error"

LEVELS = (TRACE, DEBUG, INFO, WARN, ERROR)


def _stderr_enabled(level: str) -> bool:
    return LEVELS.index(level) >= LEVELS.index(INFO)


def _stderr_log(level: str, message: str) -> None:
    print(f"[{level}] {message}", file=sys.stderr)


# Where lines go: replaced by capstan.component inside the sandbox, and by tests.
_enabled: Callable[[str], bool] = _stderr_enabled
_log: Callable[[str, str], None] = _stderr_log


def set_backend(enabled: Callable[[str], bool], log: Callable[[str, str], None]) -> None:
    """Sends lines to ``log`` when ``enabled(level)``; the SDK's own plumbing."""
    global _enabled, _log
    _enabled, _log = enabled, log


def enabled(level: str) -> bool:
    """Whether a line at ``level`` would be recorded; cheap."""
    return _enabled(level)


def log(level: str, message: str) -> None:
    """Records one line at ``level`` (one of ``trace``, ``debug``, ``info``, ``warn``,
    ``error``). Never log secrets."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {LEVELS}")
    if _enabled(level):
        _log(level, message)


def trace(message: str) -> None:
    """Logs at trace level."""
    log(TRACE, message)


def debug(message: str) -> None:
    """Logs at debug level."""
    log(DEBUG, message)


def info(message: str) -> None:
    """Logs at info level."""
    log(INFO, message)


def warn(message: str) -> None:
    """Logs at warn level."""
    log(WARN, message)


def error(message: str) -> None:
    """Logs at error level."""
    log(ERROR, message)


def level_of(levelno: int) -> str:
    """The contract's level for a ``logging`` level number."""
    if levelno >= logging.ERROR:
        return ERROR
    if levelno >= logging.WARNING:
        return WARN
    if levelno >= logging.INFO:
        return INFO
    if levelno >= logging.DEBUG:
        return DEBUG
    return TRACE


class Handler(logging.Handler):
    """A ``logging`` handler writing to the host's log::

        logging.getLogger().addHandler(capstan.log.Handler())
    """

    def emit(self, record: logging.LogRecord) -> None:
        level = level_of(record.levelno)
        if enabled(level):
            try:
                _log(level, self.format(record))
            except Exception:  # logging must never break a reconcile
                self.handleError(record)


class Captured:
    """A log backend that keeps lines in memory, for tests: ``with Captured() as lines``."""

    def __init__(self, min_level: str = TRACE):
        self.lines: List[Tuple[str, str]] = []
        self._min = LEVELS.index(min_level)
        self._saved = (_enabled, _log)

    def __enter__(self) -> List[Tuple[str, str]]:
        self._saved = (_enabled, _log)
        set_backend(lambda lv: LEVELS.index(lv) >= self._min, lambda lv, m: self.lines.append((lv, m)))
        return self.lines

    def __exit__(self, *exc) -> None:
        set_backend(*self._saved)
