"""fuseml.settings: the user settings, each with its default, a good value and a bad one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuseml import settings

# (name, accessor, default value, a good text and its value, a bad text, what is allowed)
CASES = [
    ("FUSEML_CACHE", settings.cache_dir, Path.home() / ".cache" / "fuseml",
     "/tmp/fuseml-cache", Path("/tmp/fuseml-cache"), None, "a folder"),
    ("FUSEML_AUTOTUNE", settings.autotune, True, "0", False, "no", "0 or 1"),
    ("FUSEML_TUNE_L2", settings.tune_l2, "cold", "warm", "warm", "hot", "cold or warm"),
    ("FUSEML_COMPILE_THREADS", settings.compile_threads, min(8, os.cpu_count() or 1),
     "3", 3, "-1", "an integer >= 0"),
    ("FUSEML_PDL", settings.pdl, True, "0", False, "true", "0 or 1"),
    ("FUSEML_FP32_DOT", settings.fp32_dot, "tf32x3", "ieee", "ieee", "tf32", "tf32x3 or ieee"),
    ("FUSEML_DIRECT_LAUNCH", settings.direct_launch, True, "0", False, "off", "0 or 1"),
    ("FUSEML_EXT_DIR", settings.ext_dir, None, "/tmp/ext", Path("/tmp/ext"), None, "a folder"),
]  # fmt: skip


def test_exactly_the_documented_settings():
    assert list(settings.SETTINGS) == [case[0] for case in CASES]
    for name, setting in settings.SETTINGS.items():
        assert setting.name == name and setting.help and "\n" not in setting.help


@pytest.mark.parametrize(("name", "get", "default", "good", "value", "bad", "allowed"), CASES)
def test_default_good_and_bad_value(monkeypatch, name, get, default, good, value, bad, allowed):
    monkeypatch.delenv(name, raising=False)
    assert get() == default
    monkeypatch.setenv(name, "")  # empty: the default
    assert get() == default
    monkeypatch.setenv(name, good)
    assert get() == value and settings.get(name) == value
    if bad is not None:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as err:
            get()
        assert str(err.value) == f"{name} must be {allowed}, got {bad!r}"
        with pytest.raises(ValueError):  # every call, not only the first
            get()


def test_folders_expand_the_home_folder(monkeypatch):
    monkeypatch.setenv("FUSEML_CACHE", "~/somewhere")
    assert settings.cache_dir() == Path.home() / "somewhere"


def test_values_are_parsed_once_per_raw_text(monkeypatch):
    monkeypatch.setattr(settings, "_parsed", {})  # (nothing parsed by earlier tests)
    monkeypatch.setenv("FUSEML_TUNE_L2", "warm")
    assert settings.tune_l2() == "warm"
    assert "warm" in settings._parsed.values() and len(settings._parsed) == 1
    calls = []
    setting = settings.SETTINGS["FUSEML_TUNE_L2"]
    monkeypatch.setitem(
        settings.SETTINGS, "FUSEML_TUNE_L2",
        settings.Setting(setting.name, setting.default, setting.allowed,
                         lambda text: calls.append(text) or setting.parse(text), setting.help),
    )  # fmt: skip
    assert settings.tune_l2() == "warm" and not calls  # a lookup, not a parse
    monkeypatch.setenv("FUSEML_TUNE_L2", "cold")
    assert settings.tune_l2() == "cold" and calls == ["cold"]  # a new text: parsed once
    assert settings.tune_l2() == "cold" and calls == ["cold"]


def test_every_change_of_the_environment_is_seen(monkeypatch):
    """Set, changed, made bad, unset: each read sees the environment as it is then."""
    monkeypatch.setenv("FUSEML_PDL", "0")
    assert settings.pdl() is False
    monkeypatch.setenv("FUSEML_PDL", "1")
    assert settings.pdl() is True
    monkeypatch.setenv("FUSEML_PDL", "yes")
    with pytest.raises(ValueError, match="FUSEML_PDL must be 0 or 1, got 'yes'"):
        settings.pdl()
    monkeypatch.delenv("FUSEML_PDL")
    assert settings.pdl() is True  # the default
    monkeypatch.setenv("FUSEML_PDL", "")  # empty: the default
    assert settings.pdl() is True


def test_describe_lists_every_setting_and_never_raises(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEML_AUTOTUNE", "0")
    monkeypatch.setenv("FUSEML_PDL", "maybe")
    rows = {row.name: row for row in settings.describe()}
    assert list(rows) == list(settings.SETTINGS)
    assert rows["FUSEML_AUTOTUNE"][:4] == ("FUSEML_AUTOTUNE", "0", "1", "env")
    assert rows["FUSEML_AUTOTUNE"].error is None
    assert rows["FUSEML_TUNE_L2"][:4] == ("FUSEML_TUNE_L2", "cold", "cold", "default")
    assert rows["FUSEML_EXT_DIR"].value == "" and rows["FUSEML_EXT_DIR"].source == "default"
    bad = rows["FUSEML_PDL"]
    assert bad.value == "maybe" and bad.source == "env"
    assert bad.error == "FUSEML_PDL must be 0 or 1, got 'maybe'"
    assert all(row.help == settings.SETTINGS[row.name].help for row in rows.values())


def test_importing_settings_loads_nothing_heavy():
    code = "import sys, fuseml.settings; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_the_library_reads_no_fuseml_variable_but_the_settings():
    """Every FUSEML_* name in the library's source (Python and CUDA) is a declared setting:
    probe switches are arguments, not environment variables."""
    import re
    from pathlib import Path

    src = Path(settings.__file__).parent
    declared = {row.name for row in settings.describe()}
    found = {}
    for path in sorted(src.rglob("*")):
        if path.suffix in (".py", ".cu", ".cuh", ".cpp", ".h"):
            for name in re.findall(r"FUSEML_[A-Z0-9_]+", path.read_text()):
                found.setdefault(name, path.relative_to(src).as_posix())
    unknown = {name: where for name, where in found.items() if name not in declared}
    assert not unknown, f"not declared in fuseml/settings.py: {unknown}"
    assert len(declared) <= 8
