"""Faults a careless or unlucky user meets, each run for real: unscorable documents, a task that fails while being
scored, a failed in-training evaluation (JSONL row and W&B value read back from an offline run), broken checkpoint
files and data lines, a broken checkpoint inside a sweep, concurrent sweeps into one folder, SIGTERM, and a rank
that stops answering (SIGSTOP) under torchrun.

Every failure must end in one `nano_eval: error:` line that names the thing and the fix, lose no result that was
computed, and exit non-zero (2 for bad input)."""

import json
import os
import shutil
import signal
import subprocess
import threading
import sys
import time
from pathlib import Path

import pytest

from nano_eval.cli import main as run_main
from nano_eval.tracking.jsonl import read_jsonl
from nano_eval.training.config import EvalHookConfig
from nano_eval.training.hook import EvalHook
from tests.process_guard import end_process_tree

DEMO = Path(__file__).resolve().parents[1] / "nano_eval" / "tasks" / "data" / "arithmetic.jsonl"

CUSTOM_TASKS = '''
from nano_eval.metrics.metric import Metric, mean
from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.demo_tasks import arithmetic_choice
from nano_eval.tasks.requests import RequestType


def broken_metric(doc, response):
    raise ZeroDivisionError("this metric divides by zero")


def empty_choice(line, task_name):
    doc = arithmetic_choice(line, task_name)
    if line["a"] == 0 and line["b"] == 2:
        doc.choices[1] = ""
    return doc


TASKS_TABLE = [
    TaskConfig(name="bad_gold", prompt_function=arithmetic_choice, hf_repo={bad!r}, metrics=["acc"]),
    TaskConfig(name="empty_choice", prompt_function=empty_choice, hf_repo={good!r}, metrics=["acc"]),
    TaskConfig(name="boom", prompt_function=arithmetic_choice, hf_repo={good!r},
               metrics=[Metric(name="boom", request_type=RequestType.LOGLIKELIHOOD, sample_fn=broken_metric,
                               corpus_fn=mean)]),
]
'''


@pytest.fixture(scope="module")
def custom_tasks(tmp_path_factory) -> str:
    """A custom-tasks file: `custom|bad_gold` (row 3 of its data has label 7 for 4 choices), `custom|empty_choice`
    (row 2 has an empty choice), `custom|boom` (a metric that raises)."""
    base = tmp_path_factory.mktemp("custom")
    rows = [json.loads(line) for line in DEMO.read_text().splitlines()[:8]]
    rows[3]["label"] = 7
    (base / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = base / "tasks.py"
    path.write_text(CUSTOM_TASKS.format(bad=str(base / "bad.jsonl"), good=str(DEMO)))
    return str(path)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("nano_eval: error:")]


# ---- documents --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task, field", [("bad_gold", "row 3: field 'gold_index' holds 7"),
                                         ("empty_choice", "row 2: field 'choices' item 1 is ''")])
def test_bad_document_stops_before_the_model_with_one_line(custom_tasks, tmp_path, capsys, task, field):
    # The checkpoint does not even exist: the documents are checked before any model is looked at.
    code = run_main(["--checkpoint", str(tmp_path / "no_model"), "--tasks", f"demo|arithmetic|0,custom|{task}|0",
                     "--custom-tasks", custom_tasks, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = _error_lines(err)
    assert f"task 'custom|{task}': split 'validation' {field}" in line and "Fix:" in line
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_task_failing_while_scored_keeps_the_others_results(custom_tasks, toy_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_main(["--checkpoint", str(toy_checkpoint), "--tasks", "demo|arithmetic|0,custom|boom|0",
                     "--custom-tasks", custom_tasks, "--output-dir", str(out), "--max-samples", "4"])
    err = capsys.readouterr().err
    assert code == 1, err
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["results"]) == ["demo|arithmetic|0"] and doc["num_docs"]["demo|arithmetic|0"] == 4
    assert doc["failed_tasks"] == {"custom|boom|0": "ZeroDivisionError: this metric divides by zero"}
    assert "custom|boom|0" in _error_lines(err)[-1] and "results.json" in _error_lines(err)[-1]


def test_hook_skips_a_task_with_bad_documents_when_fail_soft(custom_tasks, toy_backend, tmp_path, capsys):
    tasks = "demo|arithmetic|0,custom|bad_gold|0"
    config = EvalHookConfig(tasks=tasks, custom_tasks=custom_tasks, max_samples=3, output_dir=tmp_path, wandb=False)
    hook = EvalHook(config, toy_backend)
    assert "task custom|bad_gold is skipped" in capsys.readouterr().err
    assert list(hook.bad_tasks) == ["custom|bad_gold"]
    assert list(hook(1).tasks) == ["demo|arithmetic|0"]
    from nano_eval.errors import BadDocumentError
    from nano_eval.training.megatron import make_non_loss_data_func

    megatron_hook = make_non_loss_data_func(config, tokenizer=None)  # Megatron's hook loads its tasks up front
    assert [spec.key for spec, _ in megatron_hook.tasks] == ["demo|arithmetic|0"]
    assert list(megatron_hook.bad_tasks) == ["custom|bad_gold"]
    with pytest.raises(BadDocumentError, match="row 3: field 'gold_index'"):
        EvalHook(EvalHookConfig(tasks=tasks, custom_tasks=custom_tasks, output_dir=tmp_path, fail_soft=False,
                                wandb=False), toy_backend)


def test_failed_hook_evaluation_leaves_a_jsonl_row_and_a_wandb_value(toy_backend, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.test_wandb import read_run

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(k, v)
    config = EvalHookConfig(tasks="demo|arithmetic|0", every_n_steps=1, max_samples=3, output_dir=tmp_path,
                            wandb_project="nano_eval_test", wandb_mode="offline")
    hook = EvalHook(config, toy_backend)
    (tmp_path / "step_2").write_text("in the way")  # step 2's results folder cannot be made: a real failure
    assert hook.maybe_evaluate(1, consumed_tokens=10) is not None
    assert hook.maybe_evaluate(2, consumed_tokens=20) is None  # fail_soft: training goes on
    assert hook.maybe_evaluate(3, consumed_tokens=30) is not None
    hook.close()
    rows = read_jsonl(tmp_path / "eval_results.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "results" not in rows[1] and "step_2" in rows[1]["failed"] and rows[1]["consumed_tokens"] == 20
    logged, _ = read_run(tmp_path)
    assert [(r["train/step"], r["eval/failed"]) for r in logged if "eval/failed" in r] == [(1, 0), (2, 1), (3, 0)]


# ---- loading errors ---------------------------------------------------------------------------------------------

def _broken_copy(toy_checkpoint, tmp_path, how: str) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(toy_checkpoint, ckpt)
    if how == "truncated":
        weights = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(weights[: len(weights) * 2 // 3])
    elif how == "config":
        (ckpt / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    elif how == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (ckpt / name).unlink()
    return ckpt


@pytest.mark.parametrize("how, expected", [
    ("truncated", "model.safetensors is truncated or corrupt"),
    ("config", "config.json: is not valid JSON (line 2 column"),
    ("tokenizer", "holds no tokenizer"),
])
def test_broken_checkpoint_files_end_in_one_line(toy_checkpoint, tmp_path, capsys, how, expected):
    ckpt = _broken_copy(toy_checkpoint, tmp_path, how)
    args = ["--checkpoint", str(ckpt), "--tasks", "demo|arithmetic|0", "--max-samples", "2",
            "--output-dir", str(tmp_path / "out")]
    code = run_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = _error_lines(err)
    assert expected in line and "Fix:" in line and "Traceback" not in err
    if how == "tokenizer":  # --tokenizer works for transformers folders too
        assert "--tokenizer" in line
        assert run_main(args + ["--tokenizer", str(toy_checkpoint)]) == 0, capsys.readouterr().err


def test_malformed_data_line_is_named(tmp_path, capsys):
    lines = DEMO.read_text().splitlines()[:5]
    lines[2] = lines[2][:-1]  # line 3 loses its closing brace
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n")
    tasks = tmp_path / "tasks.py"
    tasks.write_text("from nano_eval.tasks.config import TaskConfig\nfrom nano_eval.tasks.demo_tasks import "
                     f"arithmetic_choice\nTASKS_TABLE = [TaskConfig(name='rows', prompt_function=arithmetic_choice, "
                     f"hf_repo={str(data)!r}, metrics=['acc'])]\n")
    code = run_main(["--checkpoint", str(tmp_path / "no_model"), "--tasks", "custom|rows|0", "--custom-tasks",
                     str(tasks), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = _error_lines(err)
    assert f"task 'custom|rows': data file {data}: line 3 is not valid JSON" in line and "Fix:" in line


# ---- sweeps -----------------------------------------------------------------------------------------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _sweep(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", "demo|arithmetic|0", "--output-dir", str(out), "--max-samples", "2",
            "--settle-s", "0", "--no-report", *extra]


def _wait_for(predicate, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def broken_run(toy_checkpoint, tmp_path_factory) -> Path:
    """checkpoint-1 and checkpoint-3 are the toy model; checkpoint-2 has a config.json that does not parse."""
    run = tmp_path_factory.mktemp("broken_run")
    for step in (1, 2, 3):
        shutil.copytree(toy_checkpoint, run / f"checkpoint-{step}")
    (run / "checkpoint-2" / "config.json").write_text("{not json")
    return run


def test_broken_checkpoint_in_a_sweep_is_recorded_and_skipped(broken_run, tmp_path, capsys):
    from nano_eval.sweep.table import read_table

    out = tmp_path / "out"
    code = run_main(_sweep(broken_run, out)[:-1])  # without --no-report: the report lists the failure
    err = capsys.readouterr().err
    assert code == 1, err
    assert "checkpoint-2" in _error_lines(err)[-1] and "failed and were skipped" in _error_lines(err)[-1]
    rows = read_table(out)
    assert sorted({r["step"] for r in rows if not r["error"]}) == [1, 3]  # lost nothing
    [failed] = [r for r in rows if r["error"]]
    assert failed["step"] == 2 and "config.json: is not valid JSON" in failed["error"]
    assert 'data-failed="1"' in (out / "report" / "index.html").read_text()
    # Another sweep into the same folder with other settings is refused, naming them.
    assert run_main(_sweep(broken_run, out, "--max-samples", "3")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "max_samples: 3 here, 2 there" in line and "--output-dir" in line


def test_second_sweep_into_a_busy_folder_stops_and_sigterm_exits_143(broken_run, tmp_path, capsys):
    out, log, run = tmp_path / "out", tmp_path / "log.txt", tmp_path / "run"
    run.mkdir()
    shutil.copytree(broken_run / "checkpoint-1", run / "checkpoint-1")
    proc = subprocess.Popen([sys.executable, "-m", "nano_eval", *_sweep(run, out, "--watch", "--poll-s", "0.2")],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    try:
        _wait_for(lambda: (out / "sweep_results.csv").exists(), 120, proc, log)
        assert run_main(_sweep(run, out)) == 2  # the same sweep again, while the first one runs
        [line] = _error_lines(capsys.readouterr().err)
        assert f"is in use by another sweep (pid {proc.pid} on" in line and "Fix:" in line and "--wait" in line
        # --wait: the same sweep waits (saying so), and runs once the first one has ended
        codes = []
        waiter = threading.Thread(target=lambda: codes.append(run_main(_sweep(run, out, "--wait"))))
        waiter.start()
        time.sleep(3)
        assert not codes and waiter.is_alive()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        waiter.join(timeout=120)
        assert codes == [0]  # the lock went with the process
    finally:
        proc.kill()
        proc.wait()
    assert "SIGTERM received" in log.read_text()
    printed = capsys.readouterr().out
    assert f"waiting for the sweep that holds {out} (pid {proc.pid} on" in printed and "1 reused" in printed


def _child_with_rank(parent: int, rank: int) -> int:
    """The pid of the torchrun worker of `rank` (a child of `parent`, by its RANK environment variable)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} under pid {parent}")


def test_a_stopped_rank_is_named_within_the_timeout(tmp_path):
    from tests.dist_utils import free_port

    run, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "log.txt"
    run.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "nano_eval", *_sweep(run, out, "--watch", "--poll-s", "0.2", "--dist-timeout", "4")]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    try:
        _wait_for(lambda: "watching" in log.read_text(), 120, proc, log)
        stopped = _child_with_rank(proc.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        _wait_for(lambda: "nano_eval: error:" in log.read_text(), 30, proc, log)
        took = time.monotonic() - start
    finally:
        # torchrun and both workers: torchrun starts each in a session of its own, out of reach of a killpg
        end_process_tree(proc.pid)
        proc.wait()
    [line] = [x for x in _error_lines(log.read_text()) if "[rank 0]" in x]
    assert line.startswith("nano_eval: error: [rank 0] sweep failed: rank 1 did not answer within 4s (--dist-timeout)")
    assert took < 4 + 2 + 6, took  # the timeout, the 2 s grace for the other ranks to check in, slack for the CPU
