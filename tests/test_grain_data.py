"""The data path in pure logic (no Ray): `GrainBatches` / `GrainEvalBatches`
over a real ArrayRecord file read through a shuffled, repeated Grain
pipeline (record (k * shards + s) * rows + r, host splits, pickling,
epochs, every error it names), `PackedDocuments` (row layout, first fit
per window, dropped tokens, random access), the worker's `BatchReader`
(host rows, read-ahead, the `rows` contract), the driver's
`check_program`, and the `lm_grain` example against a plain loop."""

from __future__ import annotations

import functools
import pickle
import random
import sys
import threading

import grain
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ray_elastic.control.preflight import check_program
from ray_elastic.data import GrainBatches, GrainEvalBatches, PackedDocuments
from ray_elastic.errors import ConfigError
from ray_elastic.layout import Layout
from ray_elastic.program import TrainProgram
from ray_elastic.worker.batches import BatchReader

N = 48  # records in the file
ROWS = 4  # rows per shard
SHARDS = 3  # shards per step: a step reads 12 records, so 2 epochs are 8 steps
SHUFFLE_SEED = 7


# A real file-backed source ----------------------------------------------------------------------

def _write_file(path, n=N) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(n):
        writer.write(np.array([i, 1000 + i, -i], np.int32).tobytes())
    writer.close()
    return str(path)


def _decode(record: bytes) -> dict:
    arr = np.frombuffer(record, np.int32)
    return {"id": np.int64(arr[0]), "x": arr.copy()}


def _file_dataset(path: str, epochs: int = 2, seed: int = SHUFFLE_SEED):
    """Module level, so a partial of it pickles: file -> shuffle -> decode -> repeat."""
    source = grain.sources.ArrayRecordDataSource([path])
    return grain.MapDataset.source(source).shuffle(seed=seed).map(_decode).repeat(epochs)


@pytest.fixture(scope="module")
def record_file(tmp_path_factory):
    return _write_file(tmp_path_factory.mktemp("records") / "data.array_record")


def _expected(path, first, count):
    ds = _file_dataset(path)
    recs = [ds[i] for i in range(first, first + count)]
    return {k: np.stack([r[k] for r in recs]) for k in recs[0]}


def _assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_step_shard_row_is_that_record_of_the_file_pipeline(record_file):
    gb = GrainBatches(functools.partial(_file_dataset, record_file), ROWS)
    ds = _file_dataset(record_file)
    assert len(ds) == 2 * N
    seen_ids = []
    for step in range(2 * N // (SHARDS * ROWS)):
        for shard in range(SHARDS):
            batch = gb(0, step, shard, SHARDS)
            assert batch["x"].shape == (ROWS, 3) and batch["x"].dtype == np.int32
            assert batch["id"].shape == (ROWS,)
            for r in range(ROWS):
                record = ds[(step * SHARDS + shard) * ROWS + r]
                assert batch["id"][r] == record["id"]
                np.testing.assert_array_equal(batch["x"][r], record["x"])
                # the decoded record is the one the file holds under that id
                i = int(batch["id"][r])
                np.testing.assert_array_equal(batch["x"][r], [i, 1000 + i, -i])
            seen_ids.extend(batch["id"].tolist())
    # the pipeline really shuffles (the test would pass trivially on identity order)
    assert seen_ids[:N] != list(range(N))
    # every record once per epoch, and epoch 2 is another permutation
    assert sorted(seen_ids[:N]) == list(range(N))
    assert sorted(seen_ids[N:]) == list(range(N))
    assert seen_ids[N:] != seen_ids[:N]


def test_the_same_step_and_shard_give_the_same_arrays(record_file):
    factory = functools.partial(_file_dataset, record_file)
    gb = GrainBatches(factory, ROWS)
    recipe = pickle.dumps(gb)
    fresh_unread = pickle.loads(recipe)  # pickled before any read
    first = gb(0, 3, 2, SHARDS)
    _assert_same(first, _expected(record_file, (3 * SHARDS + 2) * ROWS, ROWS))
    _assert_same(first, gb(0, 3, 2, SHARDS))  # again
    _assert_same(first, gb(12345, 3, 2, SHARDS))  # the trainer's seed is not used: the pipeline's seeds decide
    _assert_same(first, GrainBatches(factory, ROWS)(0, 3, 2, SHARDS))  # a new object
    _assert_same(first, GrainBatches(_file_dataset(record_file), ROWS)(0, 3, 2, SHARDS))  # the dataset itself
    _assert_same(first, fresh_unread(0, 3, 2, SHARDS))
    shipped = pickle.dumps(gb)  # pickled after a read: the recipe, not the built dataset (nor its file handles)
    assert shipped == recipe
    read = pickle.loads(shipped)
    assert read._records._built is None and read.rows_per_shard == ROWS
    _assert_same(first, read(0, 3, 2, SHARDS))
    # another shuffle seed is another order: the equality above is not vacuous
    other = GrainBatches(functools.partial(_file_dataset, record_file, seed=SHUFFLE_SEED + 1), ROWS)
    assert not np.array_equal(other(0, 3, 2, SHARDS)["id"], first["id"])


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_host_rows_concatenate_to_the_shard(record_file, hosts):
    gb = GrainBatches(functools.partial(_file_dataset, record_file), ROWS)
    per = ROWS // hosts
    for step, shard in ((0, 0), (2, 1), (7, 2)):
        whole = gb(0, step, shard, SHARDS)
        parts = [gb(0, step, shard, SHARDS, rows=slice(h * per, (h + 1) * per)) for h in range(hosts)]
        assert all(p["x"].shape[0] == per for p in parts)
        _assert_same(whole, {k: np.concatenate([p[k] for p in parts]) for k in whole})


def test_grain_eval_batches_read_fixed_held_out_shards(record_file):
    ev = GrainEvalBatches(functools.partial(_file_dataset, record_file, epochs=1), ROWS)
    ds = _file_dataset(record_file, epochs=1)
    for shard in range(SHARDS):
        batch = ev(0, shard, SHARDS)
        np.testing.assert_array_equal(batch["id"], [ds[shard * ROWS + r]["id"] for r in range(ROWS)])
        _assert_same(batch, ev(99, shard, SHARDS))
        half = ev(0, shard, SHARDS, rows=slice(2, 4))
        _assert_same(half, {k: v[2:] for k, v in batch.items()})
    ev.check(1000, N // ROWS)  # the held-out set does not grow with the steps
    with pytest.raises(ConfigError) as e:
        ev.check(1, N // ROWS + 1)
    assert e.value.setting == "program.make_eval_batch" and f"has {N} records" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ev(0, N // ROWS, SHARDS)
    assert e.value.setting == "program.make_eval_batch" and "held-out shard" in str(e.value)


# Errors -----------------------------------------------------------------------------------------

def _config_error(fn, *args, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    assert e.value.setting == "program.make_batch", e.value
    assert "program.make_batch" in str(e.value)
    return e.value


def test_a_dataset_too_short_says_its_length_and_the_step(record_file):
    gb = GrainBatches(functools.partial(_file_dataset, record_file), ROWS)
    steps = 2 * N // (SHARDS * ROWS)  # 8: exactly two epochs
    gb.check(steps, SHARDS)
    message = str(_config_error(gb.check, steps + 1, SHARDS))
    assert f"has {2 * N} records" in message and f"runs out at step {steps}" in message
    assert f"of the {steps + 1} asked" in message
    # 5 shards of 4 rows: 20 a step, 96 records -> step 4 is the first it cannot read
    message = str(_config_error(gb.check, 5, 5))
    assert "has 96 records" in message and "runs out at step 4" in message
    gb.check(4, 5)
    # a direct read past the end
    gb(0, steps - 1, SHARDS - 1, SHARDS)  # the last shard that exists
    message = str(_config_error(gb, 0, steps, 0, SHARDS))
    assert f"step {steps}, shard 0" in message and f"has {2 * N}" in message
    assert f"up to {(steps * SHARDS) * ROWS + ROWS - 1}" in message
    # rows within the last shard but the shard beyond the end
    _config_error(gb, 0, steps, 0, SHARDS, rows=slice(2, 4))
    # a repeat() without end is never too short
    endless = GrainBatches(lambda: grain.MapDataset.source(grain.sources.ArrayRecordDataSource([record_file]))
                           .map(_decode).repeat(), ROWS)
    endless.check(10**9, 64)
    assert endless(0, 10**6, 3, 64)["x"].shape == (ROWS, 3)


def test_a_dataset_that_is_not_a_map_dataset():
    iter_ds = GrainBatches(lambda: grain.MapDataset.range(100).map(lambda i: {"x": i}).to_iter_dataset(), 2)
    message = str(_config_error(iter_ds, 0, 0, 0, 1))
    assert "not a grain.MapDataset" in message and "IterDataset" in message
    _config_error(iter_ds.check, 1, 1)
    # not callable and not a MapDataset: refused when made
    _config_error(GrainBatches, [{"x": 1}] * 10, 2)
    _config_error(GrainBatches, grain.MapDataset.range(10).to_iter_dataset(), 2)


def test_records_that_are_not_dicts():
    gb = GrainBatches(grain.MapDataset.range(100), 2)
    assert "dicts" in str(_config_error(gb, 0, 0, 0, 1))
    pairs = GrainBatches(grain.MapDataset.range(100).map(lambda i: (i, i)), 2)
    assert "tuple" in str(_config_error(pairs, 0, 1, 0, 1))


def test_a_filter_hole():
    ds = grain.MapDataset.range(40).map(lambda i: {"x": np.int32(i)}).filter(lambda d: int(d["x"]) != 5)
    gb = GrainBatches(ds, 4)
    np.testing.assert_array_equal(gb(0, 0, 0, 1)["x"], [0, 1, 2, 3])  # no hole there
    message = str(_config_error(gb, 0, 1, 0, 1))  # records 4..7
    assert "record 5 is None" in message and "step 1, shard 0" in message


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4", None])
def test_rows_per_shard_must_be_a_positive_integer(bad):
    assert "rows_per_shard" in str(_config_error(GrainBatches, grain.MapDataset.range(10), bad))
    with pytest.raises(ConfigError) as e:
        GrainEvalBatches(grain.MapDataset.range(10), bad)
    assert e.value.setting == "program.make_eval_batch"


def test_rows_must_be_contiguous():
    gb = GrainBatches(grain.MapDataset.range(40).map(lambda i: {"x": np.int32(i)}), 4)
    with pytest.raises(ValueError, match="contiguous"):
        gb(0, 0, 0, 1, rows=slice(0, 4, 2))
    assert GrainBatches(grain.MapDataset.range(4), np.int64(2)).rows_per_shard == 2


# PackedDocuments --------------------------------------------------------------------------------

LENGTH = 16
DOCS_PER_WINDOW = 8
ROWS_PER_WINDOW = 4
NUM_DOCS = 6 * DOCS_PER_WINDOW + 3  # 3 documents past the last whole window


def _doc_length(i: int) -> int:
    return random.Random(i).choice((0, 1, 3, 5, 7, 9, 12, 16, 20, 25))


def _make_doc(i) -> dict:
    i = int(i)
    return {"tokens": (np.arange(_doc_length(i)) + 1 + 100 * i).astype(np.int32)}


def _documents():
    return grain.MapDataset.range(NUM_DOCS).map(_make_doc)


def _packed():
    return PackedDocuments(_documents(), LENGTH, docs_per_window=DOCS_PER_WINDOW, rows_per_window=ROWS_PER_WINDOW)


def _reference_first_fit(window: int):
    """(row -> list of doc indexes, dropped tokens): first fit, in order, documents cut to the row."""
    rows, free, dropped = [[] for _ in range(ROWS_PER_WINDOW)], [LENGTH] * ROWS_PER_WINDOW, 0
    for i in range(window * DOCS_PER_WINDOW, (window + 1) * DOCS_PER_WINDOW):
        size = min(_doc_length(i), LENGTH)
        if size == 0:
            continue
        fits = [r for r in range(ROWS_PER_WINDOW) if free[r] >= size]
        if not fits:
            dropped += size
            continue
        rows[fits[0]].append(i)
        free[fits[0]] -= size
    return rows, dropped


def _segments(row):
    """The row's documents: [(segment id, tokens, positions)], checking the padding."""
    seg = row["segment_ids"]
    used = int(np.count_nonzero(seg))
    assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0), seg  # documents first, then padding
    assert np.all(row["tokens"][used:] == 0) and np.all(row["positions"][used:] == 0)
    out = []
    for n in range(1, int(seg.max(initial=0)) + 1):
        where = np.flatnonzero(seg == n)
        assert where.size and np.all(np.diff(where) == 1), seg  # each segment is one contiguous run
        out.append((n, row["tokens"][where], row["positions"][where]))
    assert sum(len(t) for _, t, _ in out) == used
    if out:
        assert [n for n, _, _ in out] == list(range(1, len(out) + 1))
        assert np.all(np.diff(seg[:used]) >= 0)  # 1, 1, 2, 2, 2, 3, ...
    return out


def test_packed_rows_hold_whole_documents_in_first_fit_order():
    packed = _packed()
    windows = NUM_DOCS // DOCS_PER_WINDOW
    assert len(packed) == windows * ROWS_PER_WINDOW
    cut_docs = dropped_docs = 0
    for w in range(windows):
        rows = [packed[w * ROWS_PER_WINDOW + j] for j in range(ROWS_PER_WINDOW)]
        want_rows, want_dropped = _reference_first_fit(w)
        kept = 0
        for j, row in enumerate(rows):
            assert sorted(row) == ["positions", "segment_ids", "tokens"]
            for k, v in row.items():
                assert v.shape == (LENGTH,) and v.dtype == np.int32, k
            segments = _segments(row)
            assert len(segments) == len(want_rows[j])
            for (_, tokens, positions), doc in zip(segments, want_rows[j]):
                np.testing.assert_array_equal(positions, np.arange(tokens.size))  # restart at 0 per document
                np.testing.assert_array_equal(tokens, _make_doc(doc)["tokens"][:LENGTH])  # the (cut) document
                cut_docs += _doc_length(doc) > LENGTH
            kept += int(np.count_nonzero(row["segment_ids"]))
        total = sum(min(_doc_length(i), LENGTH) for i in range(w * DOCS_PER_WINDOW, (w + 1) * DOCS_PER_WINDOW))
        assert packed.dropped_tokens(w) == want_dropped
        assert kept + packed.dropped_tokens(w) == total
        dropped_docs += want_dropped > 0
    # the corpus exercises the cases the checks are for
    assert cut_docs and dropped_docs


def test_packed_rows_are_random_access():
    forward = _packed()
    order = list(range(len(forward)))
    rows = [forward[i] for i in order]
    backward = _packed()
    reversed_rows = [backward[i] for i in reversed(order)][::-1]
    shuffled = _packed()
    perm = random.Random(0).sample(order, len(order))
    shuffled_rows = dict((i, shuffled[i]) for i in perm)
    for i in order:
        _assert_same(rows[i], reversed_rows[i])
        _assert_same(rows[i], shuffled_rows[i])
        _assert_same(rows[i], _packed()[i])  # a fresh object
    for i in reversed(order):  # the same object, read again backwards
        _assert_same(rows[i], forward[i])
    # slices are MapDatasets of the same rows
    _assert_same(forward[5:9][2], rows[7])


def test_packed_documents_feed_grain_batches_and_repeat():
    endless = PackedDocuments(_documents().repeat(), LENGTH, docs_per_window=DOCS_PER_WINDOW,
                              rows_per_window=ROWS_PER_WINDOW)
    assert len(endless) == sys.maxsize
    gb = GrainBatches(_packed, ROWS_PER_WINDOW)
    packed = _packed()
    for step in range(3):
        for shard in range(2):
            batch = gb(0, step, shard, 2)
            first = (step * 2 + shard) * ROWS_PER_WINDOW
            _assert_same(batch, {k: np.stack([packed[first + r][k] for r in range(ROWS_PER_WINDOW)])
                                 for k in batch})
            _assert_same(batch, {k: np.stack([endless[first + r][k] for r in range(ROWS_PER_WINDOW)])
                                 for k in batch})
    with pytest.raises(ValueError, match="length"):
        PackedDocuments(_documents(), 0)
    with pytest.raises(ValueError, match="rows_per_window"):
        PackedDocuments(_documents(), 8, rows_per_window=True)


def test_packed_rows_read_from_threads_agree():
    """A read-ahead thread and the step both read rows (the window cache is shared)."""
    packed = _packed()
    want = [_packed()[i] for i in range(len(packed))]
    errors = []

    def read(order):
        try:
            for i in order:
                got = packed[i]
                for k in got:
                    if not np.array_equal(got[k], want[i][k]):
                        errors.append((i, k))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(list(range(len(packed)))[::s],)) for s in (1, -1, 3, -2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# BatchReader ------------------------------------------------------------------------------------

def _ids_dataset():
    return grain.MapDataset.range(400).map(lambda i: {"id": np.int64(i), "x": np.full(3, i, np.float32)})


class _Spy:
    """A make_batch that takes rows, recording what it is asked (and on which thread)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, seed, step, shard, num_shards, rows=None):
        self.calls.append((step, shard, rows, threading.current_thread().name))
        return self.inner(seed, step, shard, num_shards, rows=rows)


def _train_program(make_batch, **kw):
    return TrainProgram(init_params=lambda key: {"w": jnp.zeros(3)},
                        loss_fn=lambda params, batch: jnp.mean(batch["x"] @ params["w"]),
                        optimizer=optax.sgd(0.1), make_batch=make_batch, **kw)


def test_batch_reader_reads_only_the_host_rows():
    gb = GrainBatches(_ids_dataset, 8)
    spy = _Spy(gb)
    program = _train_program(spy)
    assert program.batch_takes_rows
    reader = BatchReader(program, seed=0, num_shards=2, rows=slice(4, 8), eval_rows=None)
    batch = reader.train(0, 1)
    np.testing.assert_array_equal(batch["id"], [12, 13, 14, 15])  # record (0 * 2 + 1) * 8 + 4 .. 7
    assert batch["x"].shape == (4, 3)
    assert spy.calls == [(0, 1, slice(4, 8), threading.current_thread().name)]  # asked for its rows only


def test_batch_reader_read_ahead_equals_a_direct_read():
    gb = GrainBatches(_ids_dataset, 8)
    spy = _Spy(gb)
    reader = BatchReader(_train_program(spy), seed=0, num_shards=2, rows=slice(0, 4), eval_rows=None)
    reader.train(0, 0)
    reader.read_ahead(1, (0, 1))
    reader.read_ahead(1, (0,))  # asked again: not read twice
    for shard in (0, 1):
        got = reader.train(1, shard)
        _assert_same(got, gb(0, 1, shard, 2, rows=slice(0, 4)))
        np.testing.assert_array_equal(got["id"], np.arange(4) + (2 + shard) * 8)
    ahead = [c for c in spy.calls if c[0] == 1]
    assert sorted(c[1] for c in ahead) == [0, 1]  # each shard of step 1 read once
    assert all(c[2] == slice(0, 4) and c[3].startswith("ray_elastic-batches") for c in ahead)  # in the background
    # a shard not read ahead is read then; read-aheads of steps already past are dropped
    reader.read_ahead(2, (1,))
    _assert_same(reader.train(3, 0), gb(0, 3, 0, 2, rows=slice(0, 4)))
    assert reader._ahead == {}


def _too_many_rows(seed, step, shard, num_shards, rows=None):
    return {"x": np.zeros((8, 3), np.float32)}  # the whole shard, whatever rows asks


def test_a_make_batch_taking_rows_must_return_them():
    reader = BatchReader(_train_program(_too_many_rows), seed=0, num_shards=2, rows=slice(2, 4), eval_rows=None)
    with pytest.raises(ConfigError) as e:
        reader.train(0, 0)
    assert e.value.setting == "program.make_batch" and "program.make_batch" in str(e.value)
    assert "(2 rows)" in str(e.value) and "gave 8" in str(e.value)
    reader.read_ahead(1, (0,))  # the same error through the background read
    with pytest.raises(ConfigError, match="program.make_batch"):
        reader.train(1, 0)


def test_a_plain_make_batch_is_cut_to_the_rows():
    calls = []

    def plain(seed, step, shard, num_shards):
        calls.append((seed, step, shard, num_shards))
        base = (step * num_shards + shard) * 8
        return {"x": np.arange(base, base + 8, dtype=np.float32)[:, None] * np.ones(3, np.float32),
                "y": np.arange(base, base + 8)}

    program = _train_program(plain)
    assert not program.batch_takes_rows
    reader = BatchReader(program, seed=5, num_shards=3, rows=slice(6, 8), eval_rows=None)
    batch = reader.train(2, 1)
    np.testing.assert_array_equal(batch["y"], [(2 * 3 + 1) * 8 + 6, (2 * 3 + 1) * 8 + 7])
    assert batch["x"].shape == (2, 3)
    assert calls == [(5, 2, 1, 3)]


def test_batch_reader_held_out_rows():
    ev = GrainEvalBatches(_ids_dataset, 8)
    program = _train_program(GrainBatches(_ids_dataset, 8), eval_every=1, make_eval_batch=ev,
                             eval_fn=lambda params, batch, ctx: 0.0)
    assert program.eval_batch_takes_rows
    reader = BatchReader(program, seed=0, num_shards=2, rows=slice(0, 4), eval_rows=slice(4, 8))
    np.testing.assert_array_equal(reader.held_out(1)["id"], [12, 13, 14, 15])

    def plain_eval(seed, shard, num_shards):
        return {"id": np.arange(8) + 100 * shard}

    program = _train_program(GrainBatches(_ids_dataset, 8), make_eval_batch=plain_eval)
    reader = BatchReader(program, seed=0, num_shards=2, rows=slice(0, 4), eval_rows=slice(4, 8))
    np.testing.assert_array_equal(reader.held_out(2)["id"], [204, 205, 206, 207])


# check_program ----------------------------------------------------------------------------------

def _data_program(rows=8, records=400, layout=Layout(), **kw):
    return _train_program(GrainBatches(grain.MapDataset.range(records).map(
        lambda i: {"x": np.full(3, i, np.float32)}), rows), layout=layout, **kw)


DATA4 = Layout(mesh=(("data", 4),))


def test_check_program_too_short_data_comes_first():
    # 10 steps x 2 shards x 6 rows = 120 records > 100; 6 rows would not split over 4 devices either
    with pytest.raises(ConfigError) as e:
        check_program(lambda: _data_program(rows=6, records=100, layout=DATA4), 4, 0, 2, 10)
    assert e.value.setting == "program.make_batch" and "has 100 records" in str(e.value)
    assert "runs out at step 8" in str(e.value)


def test_check_program_rows_that_do_not_split_over_the_batch_axes():
    with pytest.raises(ConfigError) as e:
        check_program(lambda: _data_program(rows=6, layout=DATA4), 4, 0, 2, 10)
    assert e.value.setting == "layout.batch_axes" and "layout.batch_axes" in str(e.value)
    assert "6 rows" in str(e.value) and "multiple of 4" in str(e.value)

    def six_rows(seed, step, shard, num_shards):  # no rows_per_shard: shard 0 of step 0 is read
        return {"x": np.zeros((6, 3), np.float32)}

    with pytest.raises(ConfigError) as e:
        check_program(lambda: _train_program(six_rows, layout=DATA4), 4, 0, 2, 10)
    assert e.value.setting == "layout.batch_axes"
    check_program(lambda: _train_program(six_rows, layout=Layout(mesh=(("data", 2), ("tensor", 2)))), 4, 0, 2, 10)


def test_check_program_microbatches_that_do_not_divide():
    with pytest.raises(ConfigError) as e:
        check_program(lambda: _data_program(rows=8, layout=DATA4, microbatches=4), 4, 0, 2, 10)
    assert e.value.setting == "program.microbatches" and "program.microbatches" in str(e.value)
    assert "4 microbatches" in str(e.value) and "multiple of 16" in str(e.value)
    check_program(lambda: _data_program(rows=8, layout=DATA4, microbatches=2), 4, 0, 2, 10)


def test_check_program_factory_must_return_a_train_program():
    with pytest.raises(ConfigError) as e:
        check_program(lambda: {"make_batch": None}, 4, 0, 2, 10)
    assert e.value.setting == "program_factory" and "dict" in str(e.value)


def test_check_program_passes_a_good_program():
    assert isinstance(check_program(lambda: _data_program(rows=8, layout=DATA4), 4, 0, 2, 10), TrainProgram)
    assert isinstance(check_program(lambda: _data_program(rows=8), 8, 0, 5, 10), TrainProgram)  # data over 8
    with pytest.raises(ConfigError) as e:  # a mesh of 4 on a slice of 8
        check_program(lambda: _data_program(rows=8, layout=DATA4), 8, 0, 2, 10)
    assert e.value.setting == "layout.mesh"


# examples/lm_grain ------------------------------------------------------------------------------

def test_lm_grain_example_matches_a_plain_loop(tmp_path):
    import examples.lm_grain as lg

    config = lg.GrainLMConfig(data_dir=str(tmp_path / "a"), num_documents=200)
    path = lg.write_corpus(config)
    data = open(path, "rb").read()
    assert data and lg.write_corpus(config) == path and open(path, "rb").read() == data
    assert [p.name for p in (tmp_path / "a").iterdir()] == [path.rsplit("/", 1)[1]]  # no temporary left
    # the corpus is a function of its seed: another folder gets the same bytes, another seed others
    other = lg.write_corpus(lg.GrainLMConfig(data_dir=str(tmp_path / "b"), num_documents=200))
    assert open(other, "rb").read() == data
    reseeded = lg.write_corpus(lg.GrainLMConfig(data_dir=str(tmp_path / "b"), num_documents=200, corpus_seed=1))
    assert open(reseeded, "rb").read() != data

    program = lg.make_program(config)
    n = 2
    for step in (0, 1, 7):
        plain = lg.plain_batches(config, step, n)
        assert len(plain) == n
        for shard in range(n):
            batch = program.make_batch(0, step, shard, n)
            _assert_same(batch, plain[shard])
            assert batch["tokens"].shape == (config.lm.shard_batch_size, config.lm.seq_len + 1)
            assert batch["segment_ids"].max() >= 1
        assert not np.array_equal(plain[0]["tokens"], plain[1]["tokens"])
    program.check_data(10**6, n)  # repeat() without end: never too short


def test_array_records_with_a_hole_and_records_with_other_keys_are_config_errors():
    import grain

    holed = grain.MapDataset.range(20).map(lambda i: np.array([i, i])).filter(lambda a: a[0] != 3)
    with pytest.raises(ConfigError, match="record 3 is None"):
        GrainBatches(holed, 4)(0, 0, 0, 1)
    mixed = grain.MapDataset.range(20).map(lambda i: {"x": np.int32(i)} if i != 2 else {"x": 1, "y": 2})
    with pytest.raises(ConfigError, match="record 2 has keys"):
        GrainBatches(mixed, 4)(0, 0, 0, 1)
