"""Tests of the user-error types (fuseml.data.errors)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from fuseml.data import CriteoFormatError, InputError, OptionError, OutputExistsError, prepare
from fuseml.data.errors import Flag, check_input_file


def test_option_error_names_parameters_or_flags() -> None:
    err = OptionError("{} needs {}, got {}", Flag("mode", "hash"), Flag("max_ind_range"), "{x}")
    assert str(err) == "mode='hash' needs max_ind_range, got {x}"  # values inserted as given
    cli = err.for_cli()
    assert str(cli) == "--mode hash needs --max-ind-range, got {x}" and cli.__cause__ is err
    assert isinstance(cli, ValueError)
    renamed = OptionError("{} is bad", Flag("out_dir")).for_cli(out_dir="--out")
    assert str(renamed) == "--out is bad"
    for e in (err, cli):
        assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_output_exists_is_a_file_exists_error() -> None:
    err = OutputExistsError("{} exists; pass {}", "d", Flag("overwrite", True))
    assert isinstance(err, FileExistsError) and isinstance(err, OptionError)
    assert str(err) == "d exists; pass overwrite=True"
    assert str(err.for_cli()) == "d exists; pass --overwrite"
    assert str(OptionError("{}", Flag("progress", False)).for_cli()) == "--no-progress"


def test_input_errors_name_file_and_line(tmp_path: Path) -> None:
    err = CriteoFormatError(tmp_path / "a.txt", 7, "bad")
    assert isinstance(err, InputError) and err.line == err.line_number == 7
    assert str(err) == f"{tmp_path / 'a.txt'}, line 7: bad"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CriteoFormatError and str(back) == str(err)
    assert str(pickle.loads(pickle.dumps(InputError("f", "why")))) == "f: why"

    with pytest.raises(FileNotFoundError, match="no such file"):
        check_input_file(tmp_path / "nope")
    with pytest.raises(InputError, match="is a directory"):
        check_input_file(tmp_path)


def test_prepared_dataset_given_as_source(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "metadata.json").write_text("{}")
    with pytest.raises(InputError, match="is a prepared dataset already"):
        prepare(tmp_path / "d", tmp_path / "out", progress=False)
