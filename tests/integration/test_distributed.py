"""fastbert.encode_dataset and `python -m fastbert encode --ray` on a local CPU Ray cluster (2 CPUs, no dashboard, one
per module), against single-process fastbert.encode on the same real texts: the same ids, every row exactly once,
cosine >= 0.99999 row by row. Then the faults: an actor process killed mid-run, a driver killed mid-run and the job
resumed, and inputs that are wrong.

The planning and reading of splits (the part that decides "every row exactly once") is also checked without Ray,
against `python -m fastbert encode`'s own reading of the same bytes."""
import glob
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import main_in_process, optional

import fastbert
from bench import procs
from fastbert.cli.encode import split_lines
from fastbert.distributed import corpus, job, shards
from fastbert.distributed.corpus import CorpusError

ray = optional("ray", reason="Ray Data is an optional extra: pip install -e '.[test]'")
pa = optional("pyarrow", reason="pyarrow comes with ray[data]")
pq = optional("pyarrow.parquet", reason="pyarrow comes with ray[data]")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # a local Ray cluster, one worker at a time

COSINE = 0.99999
CPU = {"kernels": "torch"}  # the PyTorch path: tests/conftest.py turns on Triton's interpreter, far too slow here
ACTOR = "ray::MapWorker(MapBatches(ShardEncoder))"  # what Ray Data's actor processes are called (their cmdline)


# ---- a real corpus: text no one here wrote ------------------------------------------------------------------------
def real_paragraphs(minilm_path) -> list[str]:
    """The bundled model's card (README.md, by the sentence-transformers authors: some paragraphs far past its
    max_seq_length of 256 tokens), then the licence texts of installed distributions, split into paragraphs."""
    with open(os.path.join(minilm_path, "README.md"), encoding="utf-8") as f:
        texts = [" ".join(p.split()) for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    for name in ("numpy", "torch", "pyarrow", "tokenizers", "transformers"):
        for file in importlib.metadata.distribution(name).files or []:
            if re.search(r"LICEN[CS]E", file.name, re.IGNORECASE) and file.locate().is_file():
                texts += [" ".join(p.split()) for p in re.split(r"\n\s*\n", file.read_text()) if len(p.strip()) > 40]
    return texts


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, minilm_path):
    """72 rows in three formats: a.txt (24 lines, one of them empty), docs/b.jsonl (24 records, the text under
    "body"), c.parquet (24 rows in row groups of 5). Returns (folder, texts in corpus order, ids in that order)."""
    paragraphs = real_paragraphs(minilm_path)
    assert len(paragraphs) >= 71
    folder = tmp_path_factory.mktemp("corpus")
    txt = paragraphs[:11] + [""] + paragraphs[11:23]
    jsonl, table = paragraphs[23:47], paragraphs[47:71]
    (folder / "a.txt").write_text("\n".join(txt) + "\n", encoding="utf-8")
    (folder / "docs").mkdir()
    (folder / "docs" / "b.jsonl").write_text("".join(json.dumps({"n": i, "body": t}) + "\n"
                                                     for i, t in enumerate(jsonl)), encoding="utf-8")
    pq.write_table(pa.table({"body": table}), folder / "c.parquet", row_group_size=5)
    # files in name order: a.txt, c.parquet, docs/b.jsonl
    texts = txt + table + jsonl
    ids = [f"a.txt:{i}" for i in range(1, 25)] + [f"c.parquet:{i}" for i in range(1, 25)] + \
          [f"docs/b.jsonl:{i}" for i in range(1, 25)]
    return folder, texts, ids


@pytest.fixture(scope="module")
def reference(corpus_dir, minilm_path):
    """Single-process fastbert.encode of the corpus, row i for the i-th text in corpus order."""
    _, texts, _ = corpus_dir
    return fastbert.encode(minilm_path, texts, device="cpu", **CPU)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module (bench.procs.local_ray_cluster)."""
    import ray.data  # noqa: F401  (imported before the tests: its import is not part of any test's state)
    with procs.local_ray_cluster() as address:
        yield address


def assert_same_embeddings(folder, reference, ids):
    """The output folder holds every id exactly once, and after sorting both by id, each vector has cosine >=
    0.99999 to the reference's and the same norm."""
    got_ids, emb = fastbert.load_embeddings(folder)
    assert len(got_ids) == len(set(got_ids)) == len(ids), "a row is missing or doubled"
    assert got_ids == ids  # shards in name order are in corpus order
    mine, theirs = np.argsort(got_ids), np.argsort(ids)
    assert [got_ids[i] for i in mine] == [ids[i] for i in theirs]
    a, b = emb[mine], reference[theirs]
    assert a.dtype == np.float32 and np.isfinite(a).all()
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= COSINE, f"lowest cosine {cos.min():.7f} (id {got_ids[mine[int(cos.argmin())]]})"
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1), rtol=1e-5)
    assert not glob.glob(os.path.join(folder, ".*.tmp")), "a temporary file was left behind"


def actor_processes() -> list[int]:
    return [pid for pid, line in procs.command_lines().items() if line.startswith(ACTOR)]


def finished_shards(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "part-*.parquet")))


# ---- on the cluster --------------------------------------------------------------------------------------------------
def test_two_workers_match_single_process_encode(cluster, corpus_dir, reference, minilm_path, tmp_path):
    """Three formats in one folder, 12 shards of up to 7 rows (a shard never spans files; Parquet shards cross
    row groups), a pool of two actors of one CPU each."""
    folder, _, ids = corpus_dir
    result = fastbert.encode_dataset(minilm_path, folder, tmp_path / "out", text_field="body", rows_per_shard=7,
                                     workers=2, cpus_per_worker=1, progress=False, **CPU)
    assert (result.rows, result.shards, result.written, result.skipped, result.dimension) == (72, 12, 12, 0, 384)
    assert 1 <= len(result.workers) <= 2 and sum(w["rows"] for w in result.workers) == 72
    assert all(w["device"] == "cpu" and w["load_s"] > 0 for w in result.workers)
    assert_same_embeddings(tmp_path / "out", reference, ids)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [s["name"] for s in manifest["shards"]] == [os.path.basename(p) for p in finished_shards(tmp_path / "out")]
    table = pq.read_table(finished_shards(tmp_path / "out")[0])
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)


def test_an_actor_killed_mid_run_is_replaced_and_every_row_lands_once(cluster, corpus_dir, reference, minilm_path,
                                                                        tmp_path):
    """SIGKILL to one of the two actor processes while it computes (its CPU time grows: it is inside a task), once
    the first shard is written: Ray restarts the actor and retries the task it was running; the job completes with
    every row exactly once and the reference's vectors."""
    folder, _, ids = corpus_dir
    out = tmp_path / "out"
    killed = {}

    def kill_one_actor():  # once the first shard is there, an actor seen computing (so inside a task) is killed
        deadline = time.time() + 240
        while time.time() < deadline and not finished_shards(out):
            time.sleep(0.05)
        # An actor between tasks uses no CPU; one inside a task gains at least a clock tick in 0.25 s even on a
        # loaded machine (a shard of 4 rows takes longer than that). The busiest is killed; the window is not a fixed
        # CPU share, so a slow machine does not keep every actor below a threshold until the job ends.
        while time.time() < deadline and len(finished_shards(out)) < 17:
            before = {pid: procs.cpu_seconds(pid) for pid in actor_processes()}
            time.sleep(0.25)
            gained = {pid: procs.cpu_seconds(pid) - t for pid, t in before.items()}
            busy = [pid for pid in sorted(gained, key=gained.get, reverse=True) if gained[pid] > 0]
            if busy and len(finished_shards(out)) < 17:
                killed.update(pid=busy[0], shards_done=len(finished_shards(out)))
                os.kill(busy[0], signal.SIGKILL)
                return

    killer = threading.Thread(target=kill_one_actor, daemon=True)
    killer.start()
    result = fastbert.encode_dataset(minilm_path, folder, out, text_field="body", rows_per_shard=4, workers=2,
                                     cpus_per_worker=1, progress=False, **CPU)
    killer.join(timeout=5)
    assert killed, "no actor was killed: none was seen computing while shards were left"
    assert killed["shards_done"] < result.shards  # work was left when it died
    assert (result.shards, result.written) == (18, 18)
    assert sum(w["rows"] for w in result.workers) == 72
    assert_same_embeddings(out, reference, ids)


def test_a_killed_job_resumes_to_the_same_result(cluster, corpus_dir, reference, minilm_path, tmp_path):
    """`python -m fastbert encode --ray ADDRESS` on this cluster, its driver killed once two shards are written:
    every shard under its final name is complete, none is doubled; a temporary file a killed write would leave and
    a shard damaged afterwards are handled by the rerun, which keeps the good shards (untouched) and writes the rest."""
    folder, _, ids = corpus_dir
    out = tmp_path / "out"
    command = [sys.executable, "-m", "fastbert", "encode", "--ray", cluster, "--model", minilm_path,
               "--input", str(folder), "--text-field", "body", "--output", str(out), "--rows-per-shard", "4",
               "--workers", "2", "--cpus-per-worker", "1", "--kernels", "torch", "--no-progress"]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(finished_shards(out)) < 2 and driver.poll() is None:
            time.sleep(0.05)
    finally:
        driver.kill()
        stdout, stderr = driver.communicate()
    assert driver.returncode == -signal.SIGKILL, f"the driver ended on its own: {stdout!r} {stderr[-2000:]!r}"
    deadline = time.time() + 60  # Ray stops the dead driver's actors; a write of theirs may land until then
    while time.time() < deadline and actor_processes():
        time.sleep(0.1)
    assert not actor_processes()
    plan = json.loads((out / "_fastbert_job.json").read_text())
    rows = {shards.shard_name(f, p, 3, 6): n for f, p, _, n, _ in plan["splits"]}
    kept = finished_shards(out)
    assert 2 <= len(kept) < 18 and not (out / "_manifest.json").exists()
    for path in kept:  # a final name is always a whole shard
        assert pq.read_metadata(path).num_rows == rows[os.path.basename(path)]
    with pytest.raises(FileNotFoundError, match="holds no finished job"):
        fastbert.load_embeddings(out)

    (out / f".{os.path.basename(kept[0])}.0123.tmp").write_bytes(b"PAR1 half a shard")  # a write cut short
    damaged = kept[-1]
    with open(damaged, "r+b") as f:  # a shard damaged on disk after it was written: redone, not trusted
        f.truncate(100)
    untouched = {p: os.stat(p).st_mtime_ns for p in kept[:-1]}

    result = fastbert.encode_dataset(minilm_path, folder, out, text_field="body", rows_per_shard=4, workers=2,
                                     cpus_per_worker=1, progress=False, **CPU)
    assert (result.shards, result.skipped, result.written) == (18, len(kept) - 1, 18 - len(kept) + 1)
    assert {p: os.stat(p).st_mtime_ns for p in untouched} == untouched
    assert_same_embeddings(out, reference, ids)
    again = fastbert.encode_dataset(minilm_path, folder, out, text_field="body", rows_per_shard=4, progress=False,
                                    **CPU)
    assert (again.written, again.skipped) == (0, 18)  # finished: nothing to do, no actor started


def test_a_row_without_the_text_field_names_its_file_and_line(cluster, minilm_path, tmp_path):
    """Found by the actor that reads it (the first line of each file is checked before any actor starts): the error
    names the file and the line; the shards of good rows are kept."""
    paragraphs = real_paragraphs(minilm_path)[:12]
    records = [{"body": t} for t in paragraphs]
    records[9] = {"text": paragraphs[9], "title": "x"}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(CorpusError, match=r"docs.jsonl: line 10 has no field 'body' \(its fields: 'text', 'title'\)"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", tmp_path / "out", text_field="body", rows_per_shard=6,
                                workers=1, cpus_per_worker=1, progress=False, **CPU)
    assert [os.path.basename(p) for p in finished_shards(tmp_path / "out")] in ([], ["part-00000-00000.parquet"])


# ---- the command line -----------------------------------------------------------------------------------------------
def run_cli(capsys, *args):
    """`python -m fastbert encode ...` in this process: (exit code, stderr lines)."""
    code, _, err = main_in_process(capsys, "encode", *args)
    return code, err.strip().splitlines()


def test_without_ray_the_command_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("one\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    code, err = run_cli(capsys, "--ray", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"))
    assert code == 2 and err == ["python -m fastbert encode: error: --ray needs Ray Data, which is not installed: "
                                 "pip install 'ray[data]>=2.60' (or, in a fastbert checkout, pip install -e '.[ray]')"]
    with pytest.raises(ImportError, match=r"needs Ray Data: pip install 'ray\[data\]>=2\.60'"):
        fastbert.encode_dataset("any/model", tmp_path / "a.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # said before anything is read or written


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--input", "{tmp}/nowhere"], "--input '{tmp}/nowhere': no such file or folder"),
    ("empty", ["--input", "{tmp}/in"], "the corpus has no rows (an empty corpus)"),
    ("nofield", ["--input", "{tmp}/in", "--text-field", "body"],
     "in/docs.jsonl: line 1 has no field 'body' (its fields: 'text')"),
    ("parquet", ["--input", "{tmp}/in"], "in/t.parquet: no column 'text' (its columns: 'body')"),
    ("unknown", ["--input", "{tmp}/in"], "notes.md: not a corpus file"),
    ("txt", ["--input", "{tmp}/in", "--output", "{tmp}/x.npy"], "with --ray the output is a folder"),
    ("txt", ["--input", "-"], "--ray reads files or a folder"),
    ("txt", ["--input", "{tmp}/in", "--ids", "{tmp}/ids.txt"], "with --ray the ids are the shards' id column"),
    ("txt", ["--input", "{tmp}/in", "--output", "{tmp}/in/out"], "is inside the input folder"),
    ("txt", ["--input", "{tmp}/in", "--id-field", "n"], "a .txt line has no fields"),
    ("txt", ["--input", "{tmp}/in", "--device", "cuda:1"], "device must be 'cpu' or 'cuda'"),
    ("txt", ["--input", "{tmp}/in", "--prompt-name", "search"], "prompt_name 'search' is not one of this model's"),
], ids=["missing", "empty", "no-text-field", "no-text-column", "unknown-suffix", "npy-output", "stdin", "ids-file",
        "output-inside-input", "txt-id-field", "device-index", "unknown-prompt"])
def test_bad_inputs_are_one_line_errors_before_any_worker_starts(tmp_path, capsys, minilm_path, setup, args,
                                                                 message):
    """Exit 2, one line on stderr, no output folder: found on the driver before any worker starts."""
    folder = tmp_path / "in"
    folder.mkdir()
    if setup == "empty":
        (folder / "a.txt").write_text("")
        (folder / "b.jsonl").write_text("")
    elif setup == "nofield":
        (folder / "docs.jsonl").write_text(json.dumps({"text": "A sentence."}) + "\n")
    elif setup == "parquet":
        pq.write_table(pa.table({"body": ["A sentence."]}), folder / "t.parquet")
    elif setup == "unknown":
        (folder / "a.txt").write_text("A sentence.\n")
        (folder / "notes.md").write_text("# notes\n")
    elif setup == "txt":
        (folder / "a.txt").write_text("A sentence.\n")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--output" not in args:
        args += ["--output", str(tmp_path / "out")]
    code, err = run_cli(capsys, "--ray", "--model", minilm_path, *args, "--no-progress")
    assert code == 2 and len(err) == 1 and err[0].startswith("python -m fastbert encode: error: "), err
    assert message.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "out").exists()


def test_ray_options_need_ray(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one\n")
    code, err = run_cli(capsys, "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "a.npy"),
                        "--workers", "2")
    assert code == 2 and err == ["python -m fastbert encode: error: --workers is an option of --ray (a corpus "
                                 "encoded by Ray workers into a folder)"]


# ---- planning and reading, without Ray -------------------------------------------------------------------------------
PRINTABLE = bytes(range(32, 127)).decode() * 3


@pytest.mark.parametrize("data, lines", [  # the expected lines written out by hand, not by the reader under test
    (b"", []), (b"\n", [""]), (b"one", ["one"]), (b"one\n", ["one"]), (b"one\r\ntwo\r\n", ["one", "two"]),
    (b"\n\n\n", ["", "", ""]), (b"a\n\nb", ["a", "", "b"]), (b"a\nb\n\n", ["a", "b", ""]),
    ("caf\u00e9\n\u00fcber\nna\u00efve\n".encode(), ["caf\u00e9", "\u00fcber", "na\u00efve"]),
    (PRINTABLE.encode() + b"\n" + b"x\n" * 40 + b"last", [PRINTABLE] + ["x"] * 40 + ["last"]),
], ids=lambda d: repr(d[:12]))
@pytest.mark.parametrize("every", [1, 2, 7])
def test_text_splits_read_exactly_the_lines_the_cli_reads(tmp_path, monkeypatch, data, lines, every):
    """Every line in exactly one split, in order, as `python -m fastbert encode` splits the same bytes (a trailing
    newline ends the last line; \\r\\n counts as one line break); the scan reads in chunks of 5 bytes here, so
    line starts fall on every side of a chunk boundary."""
    monkeypatch.setattr(corpus, "_SCAN_CHUNK", 5)
    (tmp_path / "t.txt").write_bytes(data)
    files = [corpus.describe(str(tmp_path), "t.txt", "txt")]
    splits = corpus.plan(str(tmp_path), files, every, "text", None)
    texts, ids = [], []
    for s in splits:
        assert 1 <= s.rows <= every
        t, i = corpus.read_split(str(tmp_path), files[0], s, "text", None)
        texts += t
        ids += i
    assert texts == lines
    assert split_lines(data, "t.txt") == lines  # the CLI's reading of the same bytes
    assert ids == [f"t.txt:{n}" for n in range(1, len(lines) + 1)]


@pytest.mark.parametrize("every", [1, 4, 5, 6, 23, 100])
def test_parquet_splits_cover_every_row_once_across_row_groups(tmp_path, every):
    values = [f"row {i}" for i in range(23)]
    pq.write_table(pa.table({"text": values, "key": list(range(23))}), tmp_path / "t.parquet", row_group_size=5)
    files = [corpus.describe(str(tmp_path), "t.parquet", "parquet")]
    for id_field, expected_ids in ((None, [f"t.parquet:{i}" for i in range(1, 24)]),
                                   ("key", [str(i) for i in range(23)])):
        texts, ids = [], []
        for s in corpus.plan(str(tmp_path), files, every, "text", id_field):
            t, i = corpus.read_split(str(tmp_path), files[0], s, "text", id_field)
            texts += t
            ids += i
        assert texts == values and ids == expected_ids


def test_jsonl_ids_from_a_field_strings_and_integers(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"t{i}", "id": i if i % 2 else f"doc-{i}"}) + "\n"
                                              for i in range(7)))
    files = [corpus.describe(str(tmp_path), "d.jsonl", "jsonl")]
    got = [corpus.read_split(str(tmp_path), files[0], s, "text", "id") for s in corpus.plan(str(tmp_path), files, 3,
                                                                                            "text", "id")]
    assert [t for texts, _ in got for t in texts] == [f"t{i}" for i in range(7)]
    assert [i for _, ids in got for i in ids] == ["doc-0", "1", "doc-2", "3", "doc-4", "5", "doc-6"]


@pytest.mark.parametrize("line, message", [
    ('{"body": "x"}', "line 3 has no field 'text' (its fields: 'body')"),
    ('{"text": 5}', "line 3: field 'text' is 5, not a string"),
    ('{"text": "x", "id": true}', "line 3: field 'id' is true, not a string or an integer"),
    ("not json", "line 3 is not valid JSON"),
    ("[1, 2]", "line 3 is a JSON list, not an object"),
    ("", "line 3 is empty"),
])
def test_bad_jsonl_rows_name_file_and_line(tmp_path, line, message):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "id": 1}\n{"text": "b", "id": 2}\n' + line + "\n")
    files = [corpus.describe(str(tmp_path), "d.jsonl", "jsonl")]
    (split,) = corpus.plan(str(tmp_path), files, 10, "text", "id")
    with pytest.raises(CorpusError) as e:
        corpus.read_split(str(tmp_path), files[0], split, "text", "id")
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}: {message}")


def test_null_parquet_text_and_a_file_changed_after_planning(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "t.parquet")
    files = [corpus.describe(str(tmp_path), "t.parquet", "parquet")]
    (split,) = corpus.plan(str(tmp_path), files, 10, "text", None)
    with pytest.raises(CorpusError, match=r"t.parquet: row 2: column 'text' is null"):
        corpus.read_split(str(tmp_path), files[0], split, "text", None)
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    files = [corpus.describe(str(tmp_path), "a.txt", "txt")]
    (split,) = corpus.plan(str(tmp_path), files, 10, "text", None)
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n")
    with pytest.raises(CorpusError, match="the file changed since the job was planned"):
        corpus.read_split(str(tmp_path), files[0], split, "text", None)


def test_an_output_folder_of_another_job_is_refused(cluster, tmp_path, minilm_path):
    """A rerun into a folder that holds a job with other options or other input files is refused, saying what
    differs (no worker starts); overwrite=True replaces that job's files and nothing else; a folder holding files
    fastbert did not write is refused even then."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("The first line.\nThe second line.\n")
    out = tmp_path / "out"
    fastbert.encode_dataset(minilm_path, tmp_path / "in", out, progress=False, **CPU)
    with pytest.raises(ValueError, match="holds another job: its rows_per_shard was 10000, now 1;"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, rows_per_shard=1, progress=False, **CPU)
    with pytest.raises(ValueError, match=r"holds another job: its normalize was None, now False;"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, normalize=False, progress=False, **CPU)
    (tmp_path / "in" / "a.txt").write_text("The first line.\nThe second line.\nA third.\n")
    with pytest.raises(ValueError, match=r"holds another job: the input files differ \(a.txt:"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, progress=False, **CPU)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files fastbert did not write \(notes.txt\)"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, overwrite=True, progress=False, **CPU)
    os.remove(out / "notes.txt")
    result = fastbert.encode_dataset(minilm_path, tmp_path / "in", out, rows_per_shard=2, overwrite=True,
                                     progress=False, **CPU)
    assert (result.shards, result.written, result.rows) == (2, 2, 3)
    assert sorted(os.listdir(out)) == ["_fastbert_job.json", "_manifest.json", "part-00000-00000.parquet",
                                       "part-00000-00001.parquet"]
    ids, emb = fastbert.load_embeddings(out)
    ref = fastbert.encode(minilm_path, ["The first line.", "The second line.", "A third."], device="cpu", **CPU)
    assert ids == ["a.txt:1", "a.txt:2", "a.txt:3"] and np.abs(emb - ref).max() < 1e-5


def test_truncate_dim_on_the_cluster_is_part_of_the_job(cluster, tmp_path, minilm_path):
    """truncate_dim reaches every actor (each shard's vectors are the first N dimensions of single-process encode's)
    and is recorded in the job: a rerun without it into the same folder is another job."""
    (tmp_path / "in").mkdir()
    texts = ["The first line.", "The second line.", "A third."]
    (tmp_path / "in" / "a.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    result = fastbert.encode_dataset(minilm_path, tmp_path / "in", out, truncate_dim=32, rows_per_shard=2,
                                     progress=False, **CPU)
    assert (result.dimension, result.rows) == (32, 3)
    ids, emb = fastbert.load_embeddings(out)
    ref = fastbert.encode(minilm_path, texts, device="cpu", **CPU)
    assert ids == ["a.txt:1", "a.txt:2", "a.txt:3"] and np.abs(emb - ref[:, :32]).max() < 1e-5
    with pytest.raises(ValueError, match=r"holds another job: .*truncate_dim"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, rows_per_shard=2, progress=False, **CPU)
    with pytest.raises(ValueError, match="truncate_dim must be None or an integer >= 1"):
        fastbert.encode_dataset(minilm_path, tmp_path / "in", out, truncate_dim=0, progress=False, **CPU)


@pytest.mark.parametrize("resources, options, expected", [
    ({"CPU": 64, "GPU": 8}, {}, {"device": "cuda", "workers": 8, "gpus": 1, "cpus": 1, "threads": None}),
    ({"CPU": 64, "GPU": 8}, {"gpus_per_worker": 0.5}, {"device": "cuda", "workers": 16, "gpus": 0.5}),
    ({"CPU": 64, "GPU": 8}, {"device": "cpu"}, {"device": "cpu", "workers": 64, "gpus": 0, "cpus": 1, "threads": 1}),
    ({"CPU": 2}, {}, {"device": "cpu", "workers": 2, "cpus": 1, "threads": 1}),
    ({"CPU": 16}, {"cpus_per_worker": 4}, {"device": "cpu", "workers": 4, "cpus": 4, "threads": 4}),
    ({"CPU": 16}, {"workers": 3}, {"workers": 3}),
    ({"CPU": 64, "GPU": 8}, {"pending": 3}, {"workers": 3}),  # never more actors than shards left
])
def test_pool_sizing(resources, options, expected):
    """One model per GPU on a GPU cluster (Ray gives each actor its own CUDA_VISIBLE_DEVICES); on CPU, workers of
    cpus_per_worker threads filling the CPUs."""
    pool = job._size_pool(resources, options.pop("pending", 1000), options.get("workers"),
                          options.get("cpus_per_worker"), options.get("gpus_per_worker"), options.get("device"))
    assert {k: pool[k] for k in expected} == expected


def test_cuda_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(ValueError, match="the Ray cluster has no GPU"):
        job._size_pool({"CPU": 4}, 10, None, None, None, "cuda")


def test_shard_names_sort_in_corpus_order():
    names = [shards.shard_name(f, p, 3, 120_000) for f in range(3) for p in range(0, 120_000, 9_999)]
    assert names == sorted(names) and names[0] == "part-00000-000000.parquet"


@pytest.mark.skipif(not hasattr(importlib.import_module("transformers"), "ModernBertModel"),
                    reason="this transformers has no ModernBERT (4.48+)")
def test_a_modernbert_folder_on_the_cluster(cluster, corpus_dir, minilm_path, tmp_path):
    """encode_dataset serves any family fastbert runs: a sentence-transformers folder built on ModernBERT gives
    single-process fastbert.encode's vectors, every row once."""
    from helpers import family_st_folder
    folder, texts, ids = corpus_dir
    model = family_st_folder("modernbert", minilm_path, tmp_path / "model")
    reference = fastbert.encode(str(model), texts, device="cpu", **CPU)
    result = fastbert.encode_dataset(str(model), folder, tmp_path / "out", text_field="body", rows_per_shard=24,
                                     workers=2, cpus_per_worker=1, progress=False, **CPU)
    assert (result.rows, result.dimension) == (72, 64)
    assert_same_embeddings(tmp_path / "out", reference, ids)
