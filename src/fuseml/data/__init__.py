"""Criteo click-log data for DLRM: reading, preprocessing, loading, synthesis.

* :mod:`fuseml.data.criteo` - streaming reader of the raw TSV files (plain or .gz).
* :mod:`fuseml.data.prepare` - DLRM preprocessing into a parquet dataset + metadata.json.
* :mod:`fuseml.data.dataset` - torch batches from a prepared dataset.
* :mod:`fuseml.data.synthetic` - Criteo-like files with known click probabilities.
* :mod:`fuseml.data.errors` - user-fixable faults: InputError (file, line), OptionError.

Typical use::

    from fuseml.data import synth, prepare, CriteoDataset
    synth(1_000_000, "data/synth.txt", seed=0, max_cardinality=100_000)
    prepare("data/synth.txt", "data/synth")  # one id per training value, tables fit the data
    train = CriteoDataset("data/synth", "train", batch_size=4096)
"""

from fuseml.data.criteo import (
    DENSE_COLUMNS,
    LABEL_COLUMN,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    CriteoChunk,
    CriteoFormatError,
    CriteoReader,
)
from fuseml.data.dataset import CriteoBatch, CriteoDataset
from fuseml.data.errors import InputError, OptionError, OutputExistsError
from fuseml.data.prepare import (
    Vocabulary,
    hash_sparse,
    load_metadata,
    prepare,
    split_of_lines,
    transform_dense,
)
from fuseml.data.synthetic import (
    KAGGLE_CARDINALITIES,
    SynthSummary,
    synth,
    synthetic_cardinalities,
)

__all__ = [
    "DENSE_COLUMNS",
    "KAGGLE_CARDINALITIES",
    "LABEL_COLUMN",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_COLUMNS",
    "CriteoBatch",
    "CriteoChunk",
    "CriteoDataset",
    "CriteoFormatError",
    "CriteoReader",
    "InputError",
    "OptionError",
    "OutputExistsError",
    "SynthSummary",
    "Vocabulary",
    "hash_sparse",
    "load_metadata",
    "prepare",
    "split_of_lines",
    "synth",
    "synthetic_cardinalities",
    "transform_dense",
]
