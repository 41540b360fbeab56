"""Errors for faults a user can fix: a bad input file, or a bad option.

* :class:`InputError` names the file and, where known, the 1-based line: a line that is
  not Criteo TSV, a truncated gzip file, a directory or an unreadable file given as input.
* :class:`OptionError` (and :class:`OutputExistsError`) name the offending options. Their
  text names them as Python parameters (``max_ind_range``); :meth:`~OptionError.for_cli`
  gives the same error naming command-line flags (``--max-ind-range``), so one message
  serves the library and the command line.

A command line shows either kind as one line and exits with status 2; they are faults of
the input, not of the program, so a traceback would only hide the message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Flag",
    "InputError",
    "InputNotFoundError",
    "OptionError",
    "OutputExistsError",
    "check_input_file",
]

_UNSET: Any = ...  # a Flag without a value (a singleton, so it survives pickling)


class InputError(ValueError):
    """A fault in an input file. Attributes: ``path``, ``line`` (1-based or None), ``reason``."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.reason = reason
        self.line = line
        where = f"{path}" if line is None else f"{path}, line {line}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The default would call __init__ with the message alone (breaks pickling across
        # processes, e.g. from DataLoader workers).
        return (type(self), (self.path, self.reason, self.line))


@dataclass(frozen=True)
class Flag:
    """An option named in a message: ``max_ind_range`` / ``--max-ind-range``, optionally
    with a value: ``mode='hash'`` / ``--mode hash``, ``overwrite=True`` / ``--overwrite``."""

    name: str
    value: Any = _UNSET

    def python(self) -> str:
        return self.name if self.value is _UNSET else f"{self.name}={self.value!r}"

    def cli(self, names: dict[str, str] | None = None) -> str:
        """The flag; ``names`` maps parameters to flags named otherwise (out_dir: --out)."""
        flag = (names or {}).get(self.name) or "--" + self.name.replace("_", "-")
        if self.value is _UNSET:
            return flag
        if isinstance(self.value, bool):
            return flag if self.value else "--no-" + flag[2:]
        return f"{flag} {self.value}"


class _FlagText:
    """Message from a template whose ``{}`` fields are filled with :class:`Flag` (rendered
    as Python names or as flags) and plain values (paths, numbers: inserted as given)."""

    template: str
    fields: tuple[Any, ...]  # not `args`: exceptions keep their message there
    cli: dict[str, str] | None  # None: Python names; else flags, with these renames

    def _setup(self, template: str, fields: tuple[Any, ...], cli: dict[str, str] | None) -> None:
        self.template, self.fields, self.cli = template, fields, cli

    def __str__(self) -> str:
        parts = [
            (a.python() if self.cli is None else a.cli(self.cli)) if isinstance(a, Flag) else a
            for a in self.fields
        ]
        return self.template.format(*parts)

    def for_cli(self, **flag_names: str) -> Any:
        """The same error naming command-line flags; keeps the original as its cause.

        ``flag_names`` maps parameters whose flag is not ``--`` + the name with dashes to
        their flag or argument name (``for_cli(out_dir="--out", src="SRC")``).
        """
        err = type(self)(self.template, *self.fields, cli=flag_names)
        err.__cause__ = self  # type: ignore[attr-defined]
        return err


class OptionError(_FlagText, ValueError):
    """An option value that cannot work: ``OptionError("{} must be at least 1, got {}",
    Flag("min_freq"), 0)`` reads ``min_freq must be at least 1, got 0`` (``--min-freq`` on
    the command line)."""

    def __init__(self, template: str, *args: Any, cli: dict[str, str] | None = None) -> None:
        self._setup(template, args, cli)
        super().__init__(str(self))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (type(self), self.template, self.fields, self.cli))


class OutputExistsError(OptionError, FileExistsError):
    """An output that exists already and would only be replaced with an option."""


def _rebuild(cls: type, template: str, args: tuple[Any, ...], cli: dict[str, str] | None) -> Any:
    return cls(template, *args, cli=cli)


class InputNotFoundError(InputError, FileNotFoundError):
    """An input file that does not exist."""


def check_input_file(path: str | Path) -> Path:
    """Return ``path`` if it is a readable file; else raise :class:`InputError` saying why."""
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a directory; give the data file(s) inside it")
    if not path.exists():
        raise InputNotFoundError(path, "no such file")
    if not path.is_file():
        raise InputError(path, "is not a regular file")
    if not os.access(path, os.R_OK):
        raise InputError(path, "cannot be read (permission denied)")
    return path
