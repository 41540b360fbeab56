"""DLRM prediction: from a prepared split or a raw TSV (with or without labels), the same
probabilities as the model; mismatched data and bad arguments are refused."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from rich.console import Console

from fuseml.apps.common import load_checkpoint, model_from_checkpoint
from fuseml.apps.predict import predict
from fuseml.apps.train import TrainOptions, train
from fuseml.data import CriteoDataset, CriteoReader, Vocabulary, prepare, synth, transform_dense
from fuseml.testing import requires_cuda


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DLRM trained for one epoch on 20k synthetic rows (vocab mode)."""
    root = tmp_path_factory.mktemp("predict")
    raw = synth(20_000, root / "raw.txt", seed=0, max_cardinality=20, progress=False).path
    data_dir = root / "prepared"
    prepare(raw, data_dir, mode="vocab", progress=False)
    options = TrainOptions(batch_size=512, optimizer="adam", lr=0.003, out_dir=root / "run")
    options.progress = False
    result = train("tiny", data_dir, options, console=Console(quiet=True))
    return root, raw, data_dir, result.checkpoint


def _quiet() -> Console:
    return Console(quiet=True)


def _model_probs(checkpoint, dense: torch.Tensor, sparse: torch.Tensor) -> np.ndarray:
    model = model_from_checkpoint(load_checkpoint(checkpoint)).eval()
    with torch.no_grad():
        return model(dense, sparse).numpy()


def test_prepared_split_to_parquet(trained, tmp_path):
    _, _, data_dir, ckpt = trained
    out = tmp_path / "preds.parquet"
    summary = predict(ckpt, data_dir, out, batch_size=1000, console=_quiet(), progress=False)
    table = pq.read_table(out)
    test = CriteoDataset(data_dir, "test", batch_size=10**6, shuffle=False)
    batch = next(iter(test))
    assert summary.rows == table.num_rows == test.num_rows
    assert table.column_names == ["row_id", "probability", "label"]
    assert table.column("row_id").to_pylist() == list(range(test.num_rows))
    np.testing.assert_array_equal(table.column("label").to_numpy(), batch.labels.numpy())
    expected = _model_probs(ckpt, batch.dense, batch.sparse)
    np.testing.assert_allclose(table.column("probability").to_numpy(), expected, rtol=1e-5)
    assert summary.metrics["auc"] > 0.55 and summary.rows_per_s > 0


def test_raw_tsv_with_and_without_labels(trained, tmp_path):
    _, raw, data_dir, ckpt = trained
    lines = raw.read_bytes().splitlines(keepends=True)[:3000]
    labelled = tmp_path / "labelled.txt"
    labelled.write_bytes(b"".join(lines))
    unlabelled = tmp_path / "unlabelled.txt"
    unlabelled.write_bytes(b"".join(line.split(b"\t", 1)[1] for line in lines))

    a = predict(
        ckpt, labelled, tmp_path / "a.csv", batch_size=700, console=_quiet(), progress=False
    )
    b = predict(ckpt, unlabelled, tmp_path / "b.csv", console=_quiet(), progress=False)
    assert a.has_labels and not b.has_labels and a.rows == b.rows == 3000
    ta, tb = pa_csv.read_csv(tmp_path / "a.csv"), pa_csv.read_csv(tmp_path / "b.csv")
    assert ta.column_names == ["row_id", "probability", "label"]
    assert tb.column_names == ["row_id", "probability"]
    assert ta.column("row_id").to_pylist() == list(range(1, 3001))  # 1-based line numbers
    # other batch sizes: the same up to float rounding
    np.testing.assert_allclose(ta.column("probability"), tb.column("probability"), rtol=1e-6)

    # the same preprocessing as the training data: dense transform + the dataset's vocabulary
    chunk = next(iter(CriteoReader(labelled, chunk_rows=10_000)))
    vocab = Vocabulary.load(data_dir / "vocabulary.npz")
    dense = torch.from_numpy(transform_dense(chunk.dense, chunk.dense_missing))
    expected = _model_probs(ckpt, dense, torch.from_numpy(vocab.lookup(chunk.sparse)))
    np.testing.assert_allclose(ta.column("probability").to_numpy(), expected, rtol=1e-5)
    np.testing.assert_array_equal(ta.column("label").to_numpy(), chunk.labels)


def test_compile_backend_pads_the_last_batch(trained, tmp_path):
    _, _, data_dir, ckpt = trained
    eager = predict(
        ckpt, data_dir, tmp_path / "e.parquet", batch_size=300, console=_quiet(), progress=False
    )
    compiled = predict(
        ckpt, data_dir, tmp_path / "c.parquet", backend="compile", batch_size=300,
        console=_quiet(), progress=False,
    )  # fmt: skip
    assert eager.rows == compiled.rows and eager.rows % 300 != 0
    np.testing.assert_allclose(
        pq.read_table(tmp_path / "c.parquet").column("probability").to_numpy(),
        pq.read_table(tmp_path / "e.parquet").column("probability").to_numpy(),
        rtol=1e-4,
        atol=1e-6,
    )


def test_optimized_backend_predicts_the_same(trained, tmp_path):
    _, _, data_dir, ckpt = trained
    console = Console(record=True, width=200)
    eager = predict(
        ckpt, data_dir, tmp_path / "e.parquet", batch_size=300, console=_quiet(), progress=False
    )
    fused = predict(
        ckpt, data_dir, tmp_path / "f.parquet", backend="auto", batch_size=300,
        console=console, progress=False,
    )  # fmt: skip
    assert "FusedMLP" in console.export_text()  # what fuseml.optimize swapped
    assert eager.rows == fused.rows
    np.testing.assert_allclose(
        pq.read_table(tmp_path / "f.parquet").column("probability").to_numpy(),
        pq.read_table(tmp_path / "e.parquet").column("probability").to_numpy(),
        rtol=1e-5,
        atol=1e-7,
    )
    bf16 = predict(
        ckpt, data_dir, tmp_path / "b.parquet", backend="auto", dtype="bf16",
        batch_size=300, console=_quiet(), progress=False,
    )  # fmt: skip
    assert bf16.metrics["auc"] == pytest.approx(eager.metrics["auc"], abs=0.01)


def test_triton_backend_predicts_the_same(trained, tmp_path):
    _, _, data_dir, ckpt = trained
    console = Console(record=True, width=200)
    eager = predict(
        ckpt, data_dir, tmp_path / "e.parquet", batch_size=1024, console=_quiet(), progress=False
    )
    fused = predict(
        ckpt, data_dir, tmp_path / "t.parquet", backend="triton", batch_size=1024,
        console=console, progress=False,
    )  # fmt: skip
    text = console.export_text()
    assert "FusedMLP" in text and "DLRM prediction (triton," in text
    assert eager.rows == fused.rows
    np.testing.assert_allclose(
        pq.read_table(tmp_path / "t.parquet").column("probability").to_numpy(),
        pq.read_table(tmp_path / "e.parquet").column("probability").to_numpy(),
        rtol=1e-5,
        atol=1e-7,
    )


def test_refuses_mismatched_data(trained, tmp_path):
    _root, raw, _, ckpt = trained
    # other table sizes (tables capped at 10 values)
    small = synth(3000, tmp_path / "small.txt", max_cardinality=10, progress=False).path
    prepare(small, tmp_path / "small", mode="vocab", progress=False)
    with pytest.raises(ValueError, match=r"table 0 \(C1\) has 22 rows in the config, 12 in"):
        predict(ckpt, tmp_path / "small", tmp_path / "p.csv", console=_quiet(), progress=False)
    # same table sizes, other id mapping (hash mode)
    cards = load_checkpoint(ckpt)["config"]["cardinalities"]
    prepare(raw, tmp_path / "hashed", mode="hash", max_ind_range=cards, progress=False)
    with pytest.raises(ValueError, match="preprocessed with .*'hash'.* trained on data .*'vocab'"):
        predict(ckpt, tmp_path / "hashed", tmp_path / "p.csv", console=_quiet(), progress=False)
    # same sizes and mode, other categories (another seed: other hex values)
    other = synth(20_000, tmp_path / "other.txt", seed=1, max_cardinality=20, progress=False)
    prepare(other.path, tmp_path / "other", mode="vocab", progress=False)
    with pytest.raises(ValueError, match="vocabulary of .* differs"):
        predict(ckpt, tmp_path / "other", tmp_path / "p.csv", console=_quiet(), progress=False)


def test_bad_arguments(trained, tmp_path):
    _, _raw, data_dir, ckpt = trained
    with pytest.raises(ValueError, match=r"^out must end in \.parquet or \.csv"):
        predict(ckpt, data_dir, tmp_path / "p.json", console=_quiet())
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'eager', 'compile'"):
        predict(ckpt, data_dir, tmp_path / "p.csv", backend="fused", console=_quiet())
    with pytest.raises(ValueError, match=r"^dtype must be one of \('fp32', 'bf16'\), got 'fp16'"):
        predict(ckpt, data_dir, tmp_path / "p.csv", dtype="fp16", console=_quiet())
    assert not (tmp_path / "p.csv").exists()
    bad = tmp_path / "bad.txt"
    bad.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="has 3 tab-separated fields"):
        predict(ckpt, bad, tmp_path / "p.csv", console=_quiet())
    with pytest.raises(FileNotFoundError, match="neither a prepared dataset folder nor a file"):
        predict(ckpt, tmp_path / "nothing", tmp_path / "p.csv", console=_quiet())
    with pytest.raises(ValueError, match="not a fuseml DLRM checkpoint"):
        torch.save({"model": {}}, tmp_path / "x.pt")
        predict(tmp_path / "x.pt", data_dir, tmp_path / "p.csv", console=_quiet())


def test_first_calls_are_timed_apart(trained, tmp_path):
    _, _, data_dir, ckpt = trained
    console = Console(record=True, width=200)
    s = predict(ckpt, data_dir, tmp_path / "p.csv", batch_size=300, console=console, progress=False)
    assert s.setup_rows == 300 and 0 < s.setup_seconds <= s.model_seconds  # the first call
    assert s.steady_rows_per_s > 0
    calls = -(-s.rows // 300) - 1  # every call after the first
    assert len(s.steady_call_seconds) == calls and all(t > 0 for t in s.steady_call_seconds)
    assert sum(s.steady_call_seconds) == pytest.approx(s.model_seconds - s.setup_seconds)
    assert min(s.steady_call_seconds) * 1e3 <= s.steady_call_ms <= max(s.steady_call_seconds) * 1e3
    text = console.export_text()
    assert "seconds in first calls" in text and "after first calls" in text
    assert f"(of {calls})" in text
    assert 0 < s.input_wait_seconds < s.seconds and "seconds waiting for input" in text


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_optimized_backend_on_cuda_serves_through_graphs(trained, tmp_path, backend):
    _, _, data_dir, ckpt = trained
    console = Console(record=True, width=200)
    eager = predict(
        ckpt, data_dir, tmp_path / "e.parquet", batch_size=300, device="cuda",
        console=_quiet(), progress=False,
    )  # fmt: skip
    fused = predict(
        ckpt, data_dir, tmp_path / "f.parquet", backend=backend, batch_size=300,
        device="cuda", console=console, progress=False,
    )  # fmt: skip
    assert "CUDA graphs captured" in console.export_text()
    assert eager.rows == fused.rows and fused.rows % 300 != 0  # a padded last batch
    np.testing.assert_allclose(
        pq.read_table(tmp_path / "f.parquet").column("probability").to_numpy(),
        pq.read_table(tmp_path / "e.parquet").column("probability").to_numpy(),
        rtol=1e-4,
        atol=1e-6,
    )


def _with_a_bad_id(data_dir, tmp_path, table: int):
    """A copy of the prepared data whose test split holds one id past ``table``'s last row."""
    import json
    import shutil

    bad = tmp_path / "bad-ids"
    shutil.copytree(data_dir, bad)
    meta = json.loads((bad / "metadata.json").read_text())
    size = meta["cardinalities"][table]
    path = bad / meta["splits"]["test"]["files"][0]
    t = pq.read_table(path)
    column = f"C{table + 1}"
    ids = t.column(column).to_numpy().copy()
    ids[5] = size
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(ids))
    pq.write_table(t, path)
    return bad


@pytest.mark.parametrize(
    "device, backend",
    [
        ("cpu", "eager"),
        ("cpu", "auto"),
        ("cpu", "compile"),
        pytest.param("cuda", "auto", marks=[pytest.mark.gpu, requires_cuda]),
        pytest.param("cuda", "eager", marks=[pytest.mark.gpu, requires_cuda]),
        pytest.param("cuda", "compile", marks=[pytest.mark.gpu, requires_cuda]),
    ],
)
def test_an_id_outside_its_table_is_an_error_and_nothing_is_written(
    trained, tmp_path, device, backend
):
    """On CUDA the fused backend checks ids inside its graphs (flags read after each
    replay), not on the host; compiled code skips the model's check, so predict makes it
    before the call. A bad id names its table, and --out is not written."""
    _, _, data_dir, ckpt = trained
    bad = _with_a_bad_id(data_dir, tmp_path, table=3)
    out = tmp_path / "p.parquet"
    with pytest.raises(ValueError, match=r"sparse ids of table 3 \(C4\) must be in \[0, "):
        predict(
            ckpt, bad, out, backend=backend, device=device, batch_size=300,
            console=_quiet(), progress=False,
        )  # fmt: skip
    assert not out.exists()


def test_writes_run_behind_in_order_and_errors_reach_the_loop(tmp_path):
    from fuseml.apps.predict import _WriteBehind, _Writer

    out = tmp_path / "p.parquet"
    writer = _WriteBehind(_Writer(out, has_labels=True), depth=2)
    for i in range(6):
        ids = np.arange(3 * i, 3 * i + 3)
        writer.write(ids, (ids / 100).astype(np.float32), (ids % 2).astype(np.int8))
    writer.commit()
    table = pq.read_table(out)
    assert table.column("row_id").to_pylist() == list(range(18))
    np.testing.assert_array_equal(
        table.column("probability").to_numpy(), (np.arange(18) / 100).astype(np.float32)
    )
    assert table.column("label").to_pylist() == [i % 2 for i in range(18)]

    # a batch the thread cannot write: raised by a later write or by commit, no file left
    bad = tmp_path / "q.parquet"
    writer = _WriteBehind(_Writer(bad, has_labels=False), depth=2)
    writer.write(np.arange(3), np.zeros(3, np.float32), None)
    writer.write(np.arange(3), np.zeros(2, np.float32), None)  # 3 ids, 2 probabilities
    try:
        for _ in range(200):
            writer.write(np.arange(3), np.zeros(3, np.float32), None)
            time.sleep(0.001)
    except ValueError as err:
        assert "not all the same length" in str(err)
        writer.abort()  # as predict's loop does
    else:
        with pytest.raises(ValueError, match="not all the same length"):
            writer.commit()
    assert list(tmp_path.iterdir()) == [out]


def test_read_ahead_depth_is_bounded_by_bytes():
    from fuseml.apps.predict import _PREFETCH_BYTES, _ROW_BYTES, prefetch_depth

    assert _ROW_BYTES == 13 * 4 + 26 * 8 + 8 + 1
    assert prefetch_depth(65536) == _PREFETCH_BYTES // (65536 * _ROW_BYTES) == 15
    assert prefetch_depth(1) == 64  # small batches: a count cap
    assert prefetch_depth(1 << 22) == 2  # huge batches: still two ahead
    for batch in (1, 100, 4096, 16384, 65536, 1 << 20):
        depth = prefetch_depth(batch)
        assert depth == 2 or depth * batch * _ROW_BYTES <= _PREFETCH_BYTES


def test_batches_are_read_ahead_in_order_and_errors_reach_the_loop():
    from fuseml.apps.predict import _prefetched

    assert list(_prefetched(range(10), depth=2)) == list(range(10))

    def failing():
        yield 1
        yield 2
        raise ValueError("data.tsv, line 3: 12 fields")

    got = []
    with pytest.raises(ValueError, match="data.tsv, line 3"):
        for item in _prefetched(failing()):
            got.append(item)
    assert got == [1, 2]

    produced = []

    def counting():
        for i in range(1000):
            produced.append(i)
            yield i

    reader = _prefetched(counting(), depth=2)
    assert next(reader) == 0
    reader.close()  # the loop ended early: the thread stops instead of reading on
    assert len(produced) <= 5

    # while the loop is busy (a model's first call), the reader fills its depth, then waits
    produced.clear()
    reader = _prefetched(counting(), depth=8)
    assert next(reader) == 0
    deadline = time.monotonic() + 10
    while len(produced) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    # 0 handed out, 1-8 queued, 9 made and waiting for room
    assert produced == list(range(10))
    assert [next(reader) for _ in range(3)] == [1, 2, 3]
    reader.close()
