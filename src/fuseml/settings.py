"""The user settings: environment variables fuseml reads, each declared once here.

Every setting is read at call time (a change of the environment takes effect on the next
call) and validated: a bad value raises ValueError naming the variable, the value and what
is allowed, instead of quietly taking another path. An unset or empty variable means the
default. Each raw value is parsed once, so a read costs a dictionary lookup.

``fuseml env`` lists them (:func:`describe`). This module imports nothing heavy: it is
read on the launch paths and by the command line before torch loads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

TUNE_L2_MODES = ("cold", "warm")
FP32_DOTS = ("tf32x3", "ieee")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``parse`` turns its text (the default's where unset or
    empty) into the value, or returns None where the text is not ``allowed``."""

    name: str
    default: str
    allowed: str  # what the error message says is allowed
    parse: Callable[[str], Any]
    help: str


def _flag(text: str) -> bool | None:
    return {"1": True, "0": False}.get(text)


def _choice(*choices: str) -> Callable[[str], str | None]:
    return lambda text: text if text in choices else None


def _int_at_least(minimum: int) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        return int(text) if re.fullmatch(r"-?\d+", text) and int(text) >= minimum else None

    return parse


def _folder(text: str) -> Path | None:
    return Path(os.path.expanduser(text)) if text else None


def _either(choices: tuple[str, ...]) -> str:
    return " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"


_DECLARED = (
    Setting(
        "FUSEML_CACHE", "~/.cache/fuseml", "a folder", _folder,
        "root of fuseml's caches: tuned configs (tune/), Triton's key (triton-key/)",
    ),
    Setting(
        "FUSEML_AUTOTUNE", "1", "0 or 1", _flag,
        "time candidate GEMM / MLP tiles on a new shape and keep the best (0: heuristic)",
    ),
    Setting(
        "FUSEML_TUNE_L2", "cold", _either(TUNE_L2_MODES), _choice(*TUNE_L2_MODES),
        "tuning times each candidate with the L2 flushed (cold) or warm",
    ),
    Setting(
        "FUSEML_COMPILE_THREADS", str(min(8, os.cpu_count() or 1)), "an integer >= 0",
        _int_at_least(0),
        "threads compiling tuning candidates in parallel (0 or 1: one at a time)",
    ),
    Setting(
        "FUSEML_PDL", "1", "0 or 1", _flag,
        "programmatic dependent launch on Hopper and later (0: plain launches)",
    ),
    Setting(
        "FUSEML_FP32_DOT", "tf32x3", _either(FP32_DOTS), _choice(*FP32_DOTS),
        "float32 GEMM dots where TF32 is off: three TF32 products, or plain fp32 FMA",
    ),
    Setting(
        "FUSEML_DIRECT_LAUNCH", "1", "0 or 1", _flag,
        "repeat launches call the compiled kernel directly (0: Triton's full launch)",
    ),
    Setting(
        "FUSEML_EXT_DIR", "", "a folder", _folder,
        "build folder of the CUDA C++ twins (default: torch's extensions folder)",
    ),
)  # fmt: skip
SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}

_parsed: dict[tuple[str, Any], Any] = {}  # (name, raw value) -> value: read on every launch


def _environ_reader():
    """name -> the variable's raw value now (None where unset). ``os.environ.get`` encodes
    the name and decodes the value on every call (0.8 us); the mapping behind os.environ
    (which every change through os.environ updates) is read with the name encoded once,
    where this Python has one."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if type(data) is not dict or encode is None:
        return lambda name: os.environ.get(name)
    keys = {name: encode(name) for name in SETTINGS}
    return lambda name: data.get(keys[name])


_raw_value = _environ_reader()


def get(name: str) -> Any:
    """The value of setting ``name`` from the environment now; ValueError if it is bad."""
    raw = _raw_value(name)
    try:
        return _parsed[name, raw]
    except KeyError:
        pass
    key = (name, raw)
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    raw = raw or ""
    setting = SETTINGS[name]
    value = setting.parse(raw or setting.default)
    if value is None and (raw or setting.default):
        raise ValueError(f"{name} must be {setting.allowed}, got {raw!r}")
    _parsed[key] = value
    return value


def cache_dir() -> Path:
    """FUSEML_CACHE: the root folder of fuseml's on-disk caches."""
    return get("FUSEML_CACHE")


def autotune() -> bool:
    """FUSEML_AUTOTUNE: tune GEMM / MLP tiles on a new shape (else the heuristic config)."""
    return get("FUSEML_AUTOTUNE")


def tune_l2() -> str:
    """FUSEML_TUNE_L2: "cold" (each timed call finds the L2 flushed) or "warm"."""
    return get("FUSEML_TUNE_L2")


def compile_threads() -> int:
    """FUSEML_COMPILE_THREADS: threads compiling tuning candidates (0 or 1: none)."""
    return get("FUSEML_COMPILE_THREADS")


def pdl() -> bool:
    """FUSEML_PDL: programmatic dependent launch allowed (Hopper and later)."""
    return get("FUSEML_PDL")


def fp32_dot() -> str:
    """FUSEML_FP32_DOT: "tf32x3" or "ieee", how float32 dots run where TF32 is off."""
    return get("FUSEML_FP32_DOT")


def direct_launch() -> bool:
    """FUSEML_DIRECT_LAUNCH: repeat launches go through the compiled kernel's launcher."""
    return get("FUSEML_DIRECT_LAUNCH")


def ext_dir() -> Path | None:
    """FUSEML_EXT_DIR: the CUDA C++ extension's build folder, None for torch's default."""
    return get("FUSEML_EXT_DIR")


class Row(NamedTuple):
    """One setting as ``fuseml env`` lists it. ``value``: the parsed value as text (the
    raw text where it is bad, with ``error`` saying why); ``source``: "env" or "default"."""

    name: str
    value: str
    default: str
    source: str
    help: str
    error: str | None = None


def describe() -> list[Row]:
    """Every setting, its value here and where that comes from; never raises."""
    rows = []
    for setting in _DECLARED:
        raw = os.environ.get(setting.name, "")
        source = "env" if raw else "default"
        try:
            value, error = get(setting.name), None
        except ValueError as err:
            value, error = raw, str(err)
        if isinstance(value, bool):
            value = "1" if value else "0"
        elif value is None:
            value = ""
        rows.append(Row(setting.name, str(value), setting.default, source, setting.help, error))
    return rows
