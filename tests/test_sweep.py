"""Checkpoint sweeps in one process: discovery of the three run-directory layouts (finished vs still being written),
selection, per-checkpoint results equal to evaluating each checkpoint alone, reuse on rerun, the consolidated
table, the learning-curve report, W&B offline logging, and memory that does not grow from checkpoint to checkpoint.

The checkpoints come from a real short CPU training run (tests/sweep_utils.py); nothing is mocked.
"""

import gc
import json
import os
import struct
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nano_eval.cli import main as run_main
from nano_eval.errors import NanoEvalError
from nano_eval.sweep.discovery import (Checkpoint, Settler, consumed_tokens, discover, is_checkpoint_dir,
                                       missing_parts, select)
from nano_eval.sweep.table import read_table
from tests.sweep_utils import TASKS, TOKENS_PER_STEP, one_thread, save_hf_checkpoint, toy_parts, train_run_dir

MAX_SAMPLES = "6"


def _weights(path: Path, truncate: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.ones(64, 64)}, str(path))
    if truncate:  # a writer caught halfway: the header promises more bytes than the file has
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])


# ---- discovery ---------------------------------------------------------------------------------------------------

def _nanotron_ckpt(run: Path, step: int, *, metadata: bool, truncate: bool = False) -> None:
    d = run / str(step)
    (d / "config.yaml").parent.mkdir(parents=True)
    (d / "config.yaml").write_text("tokens: {sequence_length: 256}\nmodel: {model_config: {}}\n")
    _weights(d / "model" / "model" / "lm_head" / "model_weight.safetensors", truncate=truncate)
    if metadata:
        metas = {"last_train_step": step, "consumed_train_samples": step * 8}
        (d / "checkpoint_metadata.json").write_text(json.dumps({"metas": metas, "tp": 1, "dp": 1, "version": "1.4"}))


def test_nanotron_run_dir(tmp_path):
    run = tmp_path / "run"
    _nanotron_ckpt(run, 200, metadata=False)  # complete through latest.txt only
    _nanotron_ckpt(run, 1000, metadata=True)  # complete through its metadata; numeric order puts it after 300
    _nanotron_ckpt(run, 300, metadata=False)  # past latest.txt, no metadata yet: still being written
    _nanotron_ckpt(run, 1100, metadata=True, truncate=True)  # metadata written, a shard cut short
    (run / "latest.txt").write_text("200")
    found = discover(run)
    assert [(c.step, c.kind) for c in found] == [(200, "nanotron"), (300, "nanotron"), (1000, "nanotron"),
                                                 (1100, "nanotron")]
    status = {c.step: missing_parts(c, run) for c in found}
    assert status[200] is None and status[1000] is None
    assert "latest.txt" in status[300] and "model_weight.safetensors" in status[1100]
    assert consumed_tokens(found[2]) == 1000 * 8 * 256  # consumed_train_samples x sequence_length
    assert not is_checkpoint_dir(run) and is_checkpoint_dir(run / "200")


def test_megatron_run_dir_and_its_loader(tmp_path):
    run = tmp_path / "run"
    for it in (100, 300, 200):
        _weights(run / f"iter_{it:07d}" / "mp_rank_00" / "model.safetensors")
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    found = discover(run)
    assert [(c.step, c.kind, c.name) for c in found] == [
        (100, "megatron", "iter_0000100"), (200, "megatron", "iter_0000200"), (300, "megatron", "iter_0000300")]
    assert [missing_parts(c, run) is None for c in found] == [True, True, False]
    (run / "latest_checkpointed_iteration.txt").write_text("release")
    assert all(missing_parts(c, run) is not None for c in found)

    from nano_eval.checkpoints.load import LoadOptions, load_backend

    # Megatron checkpoints go to the Megatron converter (tested in tests/test_megatron.py), which needs a tokenizer
    with pytest.raises(NanoEvalError, match="iter_0000100.*do not hold a tokenizer"):
        load_backend(str(found[0].path), LoadOptions())


def _torchtitan_ckpt(path: Path, *, index: bool = True, model_file: dict | None = None) -> Path:
    """A torchtitan DCP step folder as its checkpointer writes it (data files, then the index last)."""
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"\0" * 64)
    if index:
        (path / ".metadata").write_bytes(b"\0" * 16)
    if model_file is not None:
        (path / "nano_eval_torchtitan.json").write_text(json.dumps(model_file))
    return path


def test_torchtitan_run_dir(tmp_path):
    """torchtitan's dump folder (checkpoint/step-N/) or its checkpoint/ folder: each DCP step folder, complete once
    its index is written (the trainer's own marker: no settling wait), consumed tokens from the hook's model file;
    an index that is a symlink leading outside or a FIFO leaves it unfinished (never opened)."""
    from nano_eval.checkpoints.megatron_dist import INDEX
    from nano_eval.checkpoints.torchtitan import MODEL_FILE
    from nano_eval.sweep.discovery import DCP_INDEX, TORCHTITAN_MODEL_FILE, has_marker, listing

    assert (DCP_INDEX, TORCHTITAN_MODEL_FILE) == (INDEX, MODEL_FILE)  # the loader's names

    dump, outside = tmp_path / "dump", tmp_path / "outside"
    folder = dump / "checkpoint"
    _torchtitan_ckpt(folder / "step-20", model_file={"module": "llama3", "config": "llama3_8b", "consumed_tokens": 40960})
    _torchtitan_ckpt(folder / "step-5")
    _torchtitan_ckpt(folder / "step-30", index=False)  # the data files are being written
    linked = _torchtitan_ckpt(folder / "step-40", index=False)
    outside.mkdir()
    (outside / ".metadata").write_bytes(b"\0" * 16)
    (linked / ".metadata").symlink_to(outside / ".metadata")
    os.mkfifo(_torchtitan_ckpt(folder / "step-50", index=False) / ".metadata")
    (dump / "tb").mkdir()  # torchtitan's other output folders are not checkpoints
    for run in (dump, folder):
        assert listing(run) == folder
        found = discover(run)
        assert [(c.step, c.kind) for c in found] == [(5, "torchtitan"), (20, "torchtitan"), (30, "torchtitan"),
                                                     (40, "torchtitan"), (50, "torchtitan")]
        status = {c.step: missing_parts(c, run) for c in found}
        assert status[5] is None and status[20] is None, status
        assert all(".metadata is not written yet" in status[s] for s in (30, 40, 50)), status
        assert [has_marker(c, run) for c in found] == [True, True, False, False, False]
        assert [consumed_tokens(c) for c in found] == [None, 40960, None, None, None]
    assert is_checkpoint_dir(folder / "step-5") and not is_checkpoint_dir(dump) and not is_checkpoint_dir(folder)
    # an HF folder named step-N stays an HF checkpoint; a `checkpoint` folder that leads outside is not listed
    assert [(c.step, c.kind) for c in discover(_hf_ckpt(tmp_path / "hf" / "step-7").parent)] == [(7, "hf")]
    other = tmp_path / "other_dump"
    other.mkdir()
    (other / "checkpoint").symlink_to(folder)
    assert listing(other) == other and discover(other) == []


def _hf_ckpt(path: Path, *, weights: bool = True, truncate: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if weights:
        _weights(path / "model.safetensors", truncate=truncate)
    return path


def test_hf_run_dir_complete_and_incomplete(tmp_path):
    run = tmp_path / "run"
    _hf_ckpt(run / "checkpoint-500")
    _hf_ckpt(run / "step_100")
    _hf_ckpt(run / "step-200")
    _hf_ckpt(run / "my_model_300")  # any folder with config.json and a number in its name
    _hf_ckpt(run / "checkpoint-600", weights=False)  # config.json written, weights not yet
    _hf_ckpt(run / "checkpoint-700", truncate=True)  # weights half written
    sharded = _hf_ckpt(run / "checkpoint-800", weights=False)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    _weights(sharded / "model-00001-of-00002.safetensors")  # second shard missing
    _hf_ckpt(run / "checkpoint-900")
    (run / "checkpoint-900" / "model.safetensors.tmp").write_bytes(b"partial")  # a writer's temporary file
    _hf_ckpt(run / "checkpoint-1000.tmp")  # a folder being written before its rename: not a checkpoint yet
    (run / "logs").mkdir()

    found = discover(run)
    assert [c.name for c in found] == ["step_100", "step-200", "my_model_300", "checkpoint-500", "checkpoint-600",
                                       "checkpoint-700", "checkpoint-800", "checkpoint-900"]
    assert all(c.kind == "hf" for c in found)
    why = {c.step: missing_parts(c, run) for c in found}
    assert [s for s, w in why.items() if w is None] == [100, 200, 300, 500]
    assert "no weights" in why[600] and "bytes but its header says" in why[700]
    assert "model-00002-of-00002.safetensors" in why[800] and "temporary" in why[900]

    _weights(sharded / "model-00002-of-00002.safetensors")
    assert missing_parts(found[6], run) is None  # every listed shard now there


def test_settling_needs_two_identical_looks_settle_s_apart(tmp_path):
    ckpt = Checkpoint(_hf_ckpt(tmp_path / "checkpoint-5"), 5, "hf")
    settler = Settler(settle_s=10)
    assert not settler.settled(ckpt, now=0.0)  # first look
    assert not settler.settled(ckpt, now=5.0)  # unchanged, but not for 10 s yet
    assert settler.wait_s(ckpt, now=5.0) == pytest.approx(5.0)
    (ckpt.path / "extra.json").write_text("{}")  # the writer is still busy
    assert not settler.settled(ckpt, now=11.0)  # changed: the clock starts again
    assert not settler.settled(ckpt, now=20.0)
    assert settler.settled(ckpt, now=21.5)
    assert Settler(settle_s=0).settled(ckpt)


def test_selection_every_range_last():
    ckpts = [Checkpoint(Path(f"/r/checkpoint-{s}"), s, "hf") for s in (10, 20, 30, 40, 50, 60)]
    steps = lambda cs: [c.step for c in cs]  # noqa: E731
    assert steps(select(ckpts, every=20)) == [20, 40, 60]
    assert steps(select(ckpts, min_step=20, max_step=50)) == [20, 30, 40, 50]
    assert steps(select(ckpts, last=2)) == [50, 60]
    assert steps(select(ckpts, every=20, last=2, max_step=50)) == [20, 40]
    assert select(ckpts, last=0) == []


# ---- a real sweep ------------------------------------------------------------------------------------------------

def _sweep_args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", TASKS, "--output-dir", str(out), "--max-samples", MAX_SAMPLES,
            "--settle-s", "0", *extra]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Six checkpoints of one short training run, swept once with W&B offline."""
    import os

    base = tmp_path_factory.mktemp("sweep")
    run, out = base / "run", base / "out"
    train_run_dir(run, saves=6, steps_per_save=8)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with one_thread():
            code = run_main(_sweep_args(run, out, "--wandb-project", "nano_eval_test", "--wandb-mode", "offline"))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert code == 0
    return run, out


STEPS = [8, 16, 24, 32, 40, 48]


def test_each_checkpoint_scores_as_when_evaluated_alone(swept, tmp_path):
    run, out = swept
    with one_thread():
        for step in STEPS:
            alone = tmp_path / f"alone-{step}"
            assert run_main(["--checkpoint", str(run / f"checkpoint-{step}"), "--tasks", TASKS, "--output-dir",
                             str(alone), "--max-samples", MAX_SAMPLES]) == 0
            a = json.loads((alone / "results.json").read_text())
            s = json.loads((out / f"checkpoint-{step}" / "results.json").read_text())
            assert s["results"] == a["results"] and s["num_docs"] == a["num_docs"], step
            assert s["step"] == step and s["consumed_tokens"] == step * TOKENS_PER_STEP
            assert sorted(p.name for p in (out / f"checkpoint-{step}" / "details").iterdir()) == sorted(
                p.name for p in (alone / "details").iterdir())
    first, last = (json.loads((out / f"checkpoint-{s}" / "results.json").read_text())["results"] for s in (8, 48))
    bpb = "demo|arithmetic_ppl|0"
    assert last[bpb]["bits_per_byte"] < first[bpb]["bits_per_byte"] - 0.3  # training moved the scores


def test_table_has_every_checkpoint_task_and_metric(swept):
    run, out = swept
    rows = read_table(out)
    assert sorted({r["step"] for r in rows}) == STEPS
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)  # step order
    assert {r["task"] for r in rows} == set(TASKS.split(","))
    doc = json.loads((out / "checkpoint-24" / "results.json").read_text())
    for r in (r for r in rows if r["step"] == 24):
        assert r["checkpoint"] == "checkpoint-24" and r["consumed_tokens"] == 24 * TOKENS_PER_STEP
        assert r["value"] == doc["results"][r["task"]][r["metric"]]
        assert r["stderr"] == doc["results"][r["task"]][f"{r['metric']}_stderr"]
    import pyarrow.parquet as pq

    parquet = pq.read_table(out / "sweep_results.parquet").to_pylist()
    assert [(p["step"], p["task"], p["metric"], p["value"]) for p in parquet] == [
        (r["step"], r["task"], r["metric"], r["value"]) for r in rows]


def test_rerun_reuses_every_finished_checkpoint(swept, capsys):
    run, out = swept
    before = {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")}
    table = (out / "sweep_results.csv").read_text()
    assert run_main(_sweep_args(run, out)) == 0
    printed = capsys.readouterr().out
    assert "6 reused" in printed
    # the end: the results table (a line per task x metric, a column per checkpoint), then where the files are
    header = next(line for line in printed.splitlines() if line.startswith("task "))
    assert header.split()[2:] == [word for s in STEPS for word in ("step", str(s))]
    lines = [line.split() for line in printed.splitlines() if line.split()[:1] in ([t] for t in TASKS.split(","))]
    assert {line[0] for line in lines} == set(TASKS.split(",")) and all(len(line) == 2 + len(STEPS) for line in lines)
    assert f"table: {out / 'sweep_results.csv'}" in printed and f"report: {out / 'report' / 'index.html'}" in printed
    assert {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")} == before
    assert (out / "sweep_results.csv").read_text() == table


def test_run_py_checkpoint_run_dir_sweeps(swept, tmp_path, capsys):
    """`nano_eval --checkpoint RUN_DIR` on a folder of checkpoints runs a sweep (sweep options allowed)."""
    import shutil

    run, out = swept[0], tmp_path / "out"
    shutil.copytree(swept[1], out)  # the module's table keeps all six checkpoints
    assert run_main(["--checkpoint", str(run), "--tasks", TASKS, "--output-dir", str(out), "--max-samples",
                     MAX_SAMPLES, "--settle-s", "0", "--last", "2"]) == 0
    assert "0 evaluated, 2 reused" in capsys.readouterr().out


def test_evaluation_identity_changes_with_what_changes_scores():
    from nano_eval.checkpoints.load import LoadOptions
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig
    from nano_eval.job import EvalJob
    from nano_eval.sweep.identity import evaluation_identity

    def job(max_samples=6, seed=0, dtype="float32", max_length=None, tokenizer=None, batch_tokens=4096,
            add_bos_token=None):
        return EvalJob(tasks="t|a|0", eval=EvalConfig(max_samples=max_samples, seed=seed, add_bos_token=add_bos_token,
                                                      batching=BatchingConfig(max_batch_tokens=batch_tokens)),
                       load=LoadOptions(dtype=dtype, max_length=max_length, tokenizer=tokenizer))

    def ident(**kw):
        return evaluation_identity(job(**kw), ["t|a|0"], {"t|a|0": 1}, "fp")

    assert ident() == ident(batch_tokens=64)  # batching never changes scores
    assert len({ident(), ident(max_samples=7), ident(seed=1), ident(dtype="bfloat16"), ident(max_length=64),
                ident(tokenizer="tok"), ident(add_bos_token=True), ident(add_bos_token=False)}) == 8
    assert evaluation_identity(job(), ["t|a|0"], {"t|a|0": 2}, "fp") != ident()
    assert evaluation_identity(job(), ["t|a|0"], {"t|a|0": 1}, "fp2") != ident()


class _ReportParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.figures, self.images, self.row_steps, self._figure = [], [], set(), None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self._figure = (a["data-task"], a["data-metric"])
            self.figures.append(self._figure)
        elif tag == "img" and self._figure:
            self.images.append((self._figure, a["src"]))
        elif tag == "tr" and "data-step" in a:
            self.row_steps.add(int(a["data-step"]))


def test_report_holds_every_task_metric_and_step(swept):
    import base64

    pytest.importorskip("matplotlib")

    run, out = swept
    rows = read_table(out)
    expected = {(r["task"], r["metric"]) for r in rows}
    parser = _ReportParser()
    parser.feed((out / "report" / "index.html").read_text())
    assert set(parser.figures) == expected and len(parser.figures) == len(expected)
    assert parser.row_steps == set(STEPS)
    assert len(parser.images) == len(expected)
    for (task, metric), src in parser.images:
        assert src.startswith("data:image/png;base64,")  # self-contained: nothing to fetch
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width > 100 and height > 100
    from nano_eval.sweep.report import file_stem

    assert {p.name for p in (out / "report").glob("*.png")} == {f"{file_stem(t, m)}.png" for t, m in expected}


def test_report_without_matplotlib_has_tables_and_one_warning(swept, tmp_path, monkeypatch, capsys):
    import shutil
    import sys

    from nano_eval.sweep.report import write_report

    shutil.copy(swept[1] / "sweep_results.csv", tmp_path / "sweep_results.csv")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import matplotlib.figure` fails, as if absent
    page = write_report(tmp_path).read_text()
    err = capsys.readouterr().err
    assert err.count("matplotlib is not installed") == 1 and "pip install -e '.[report]'" in err
    assert "<img" not in page and "<svg" not in page and 'data-signal="1"' in page
    assert page.count("<figure") == len({(r["task"], r["metric"]) for r in read_table(tmp_path)})
    assert not list((tmp_path / "report").glob("*.png"))


def test_wandb_offline_run_is_keyed_by_step_and_tokens(swept):
    pytest.importorskip("wandb")
    from tests.test_wandb import read_run

    run, out = swept
    rows, step_metrics = read_run(out)
    assert step_metrics["eval/*"] == "train/step" and step_metrics["train/consumed_tokens"] == "train/step"
    evals = [r for r in rows if "eval/demo|arithmetic|0/acc" in r]
    assert [r["train/step"] for r in evals] == STEPS  # one row per checkpoint, in step order
    assert [r["train/consumed_tokens"] for r in evals] == [s * TOKENS_PER_STEP for s in STEPS]
    table = {(r["step"], r["task"], r["metric"]): r["value"] for r in read_table(out)}
    for r in evals:
        assert r["eval/demo|arithmetic_ppl|0/bits_per_byte"] == table[r["train/step"], "demo|arithmetic_ppl|0",
                                                                      "bits_per_byte"]


def test_wandb_resumed_run_gets_only_what_the_sweep_adds(swept, tmp_path, monkeypatch):
    """`--wandb-run-id` resumes a run (e.g. the training run's): checkpoints evaluated earlier are not logged twice."""
    import shutil

    pytest.importorskip("wandb")
    from tests.test_wandb import read_run

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    shutil.copytree(swept[1], out, ignore=shutil.ignore_patterns("wandb"))
    shutil.rmtree(out / "checkpoint-48")  # the one checkpoint this sweep still has to evaluate
    with one_thread():
        assert run_main(_sweep_args(swept[0], out, "--wandb-run-id", "train-run-7", "--wandb-mode", "offline")) == 0
    assert [p.name.endswith("-train-run-7") for p in (out / "wandb").glob("offline-run-*")] == [True]
    rows, step_metrics = read_run(out)
    assert [r["train/step"] for r in rows if "eval/demo|arithmetic|0/acc" in r] == [48]
    assert step_metrics["eval/*"] == "train/step"


def test_unfinished_checkpoint_is_skipped_with_a_warning_and_empty_dir_is_an_error(swept, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    assert run_main(_sweep_args(run, tmp_path / "o")) == 2
    assert "no checkpoints found" in capsys.readouterr().err
    shutil.copytree(swept[0] / "checkpoint-8", run / "checkpoint-8")
    _hf_ckpt(run / "checkpoint-16", truncate=True)
    assert run_main(_sweep_args(run, tmp_path / "o")) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint" in captured.err and "checkpoint-16" in captured.err
    assert {r["step"] for r in read_table(tmp_path / "o")} == {8}
    assert not (tmp_path / "o" / "checkpoint-16").exists()


@pytest.mark.slow
def test_nanotron_run_dir_sweeps_like_each_checkpoint_alone(tmp_path):
    """A run directory written by nanotron's own save functions: steps in numeric order, consumed tokens from
    checkpoint_metadata.json x config.yaml's sequence length, scores equal to `--checkpoint RUN/<step>` alone."""
    pytest.importorskip("nanotron")
    from tests.dist_utils import run_distributed
    from tests.sweep_utils import save_nanotron_run

    run, tok = tmp_path / "run", tmp_path / "tokenizer"
    toy_parts()[0].save_pretrained(tok)
    run_distributed(save_nanotron_run, 1, str(run), str(tok), [5, 10, 100], timeout=300)
    (run / "100" / "checkpoint_metadata.json").unlink()  # as if step 100 were still being written
    (run / "latest.txt").write_text("10")
    tasks = "demo|arithmetic|0,demo|arithmetic_ppl|0"
    with one_thread():
        assert run_main(["sweep", str(run), "--tasks", tasks, "--output-dir", str(tmp_path / "out"),
                         "--max-samples", "4"]) == 0
        for step in (5, 10):
            assert run_main(["--checkpoint", str(run / str(step)), "--tasks", tasks, "--max-samples", "4",
                             "--output-dir", str(tmp_path / f"alone-{step}")]) == 0
    rows = read_table(tmp_path / "out")
    assert sorted({(r["checkpoint"], r["step"], r["consumed_tokens"]) for r in rows}) == [
        ("10", 10, 10 * 4 * 128), ("5", 5, 5 * 4 * 128)]
    for step in (5, 10):
        alone = json.loads((tmp_path / f"alone-{step}" / "results.json").read_text())["results"]
        assert json.loads((tmp_path / "out" / str(step) / "results.json").read_text())["results"] == alone
    assert not (tmp_path / "out" / "100").exists()


# ---- memory ------------------------------------------------------------------------------------------------------

def _rss_mib() -> float:
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sweep_memory(tmp_path: Path, n: int, device: str = "cpu") -> tuple[list[float], list[int], float]:
    """Sweep `n` copies of a ~10 MiB model; after each checkpoint record RSS (or CUDA memory allocated, on cuda) and
    how many models are still alive."""
    from transformers import PreTrainedModel

    from nano_eval.cli.options import eval_job
    from nano_eval.cli.sweep import parse, sweep_options
    from nano_eval.sweep.runner import SweepRunner

    tokenizer, model = toy_parts(hidden=256, layers=4)
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    for i in range(1, n + 1):
        save_hf_checkpoint(model, tokenizer, tmp_path / "run" / f"checkpoint-{i}", i)
    del model
    args = parse([str(tmp_path / "run"), "--tasks", "demo|arithmetic|0", "--output-dir", str(tmp_path / "out"),
                  "--max-samples", "4", "--settle-s", "0", "--no-report", "--no-details", "--device", device])
    rss, alive = [], []

    def models_alive() -> int:
        return sum(issubclass(type(o), PreTrainedModel) for o in gc.get_objects())

    gc.collect()
    before = models_alive()  # other tests' session fixtures may hold models in this process

    def after(ckpt, reused):
        alive.append(models_alive() - before)
        rss.append(torch.cuda.memory_allocated() / 2**20 if device == "cuda" else _rss_mib())

    with one_thread():
        SweepRunner(eval_job(args, args.tasks), sweep_options(args), after_checkpoint=after).run()
    return rss, alive, model_mib


@pytest.mark.slow
def test_memory_is_freed_between_checkpoints(tmp_path):
    rss, alive, model_mib = _sweep_memory(tmp_path, 8)
    assert alive == [0] * 8  # no model object outlives its checkpoint
    assert model_mib > 10
    assert rss[-1] - rss[1] < 2 * model_mib, (rss, model_mib)  # a leak would add one model per checkpoint


@pytest.mark.slow
def test_memory_does_not_grow_over_50_checkpoints(tmp_path):
    rss, alive, model_mib = _sweep_memory(tmp_path, 50)
    assert alive == [0] * 50
    assert rss[-1] - rss[2] < 2 * model_mib, (rss, model_mib)  # 50 leaked models would be ~50x that


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_is_released_between_checkpoints(tmp_path):
    allocated, alive, model_mib = _sweep_memory(tmp_path, 8, device="cuda")
    assert alive == [0] * 8
    assert max(allocated) - allocated[0] < model_mib / 2, allocated  # nothing of the last model stays allocated


def test_wandb_run_gets_the_signal_table(swept):
    """The ranked signal table (sweep_signal.csv) is logged as the W&B table `sweep/signal_to_noise`."""
    pytest.importorskip("wandb")
    import csv

    run, out = swept
    [table] = list(out.glob("wandb/offline-run-*/files/media/table/sweep/signal_to_noise_*.table.json"))
    logged = json.loads(table.read_text())
    local = list(csv.DictReader((out / "sweep_signal.csv").open()))
    assert logged["columns"][:3] == ["rank", "task", "metric"] and len(logged["data"]) == len(local) == len(
        {(r["task"], r["metric"]) for r in read_table(out)})
    assert [(r[1], r[2]) for r in logged["data"]] == [(r["task"], r["metric"]) for r in local]


def test_terminal_table_shows_the_last_checkpoints_and_each_failure():
    """The end-of-sweep table stays narrow on a long sweep: the last 8 checkpoints as columns, a line saying the
    rest are in the CSV, and one line per failed checkpoint."""
    from nano_eval.sweep.table import text_table

    rows = [{"step": s, "checkpoint": f"checkpoint-{s}", "task": "demo|arithmetic|0", "metric": "acc",
             "value": s / 100, "stderr": None, "error": ""} for s in range(10, 130, 10)]
    rows.append({"step": 130, "checkpoint": "checkpoint-130", "task": "", "metric": "", "value": None,
                 "stderr": None, "error": "config.json: not JSON"})
    lines = text_table(rows).splitlines()
    assert lines[0].split() == ["task", "metric"] + [w for s in range(60, 140, 10) for w in ("step", str(s))]
    assert lines[2].split() == ["demo|arithmetic|0", "acc", *(f"{s / 100:.4f}" for s in range(60, 130, 10))]
    assert lines[3] == "(the last 8 of 13 checkpoints; every one is in sweep_results.csv)"
    assert lines[4] == "step 130 (checkpoint-130) failed: config.json: not JSON"
