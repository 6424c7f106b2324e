"""W&B logging of the in-training hook, read back from real offline runs (no network).

wandb 0.31 ships no Python reader for its `.wandb` transaction log (the old `wandb.sdk.internal.datastore` is
gone) and offline runs write no `wandb-summary.json`, so `read_wandb_records` below parses the file: a LevelDB-style
log (7-byte file header ":W&B" + magic + version, 32 KiB blocks, records framed as crc32c/length/type) whose
payloads are `wandb.proto.wandb_internal_pb2.Record` messages.
"""

import json
import struct
import time
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from nano_eval.tracking.jsonl import read_jsonl  # noqa: E402
from nano_eval.training.config import EvalHookConfig  # noqa: E402
from nano_eval.training.hook import EvalHook  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
BLOCK = 32 * 1024


def read_wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a .wandb transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # block trailer padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding up to the end of the block
            pos += (BLOCK - pos % BLOCK) % BLOCK
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL / FIRST start, MIDDLE / LAST continue
        if kind in (1, 4):  # FULL / LAST end a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_run(root: Path, finished: bool = True) -> tuple[list[dict], dict[str, str]]:
    """(history rows, {metric name or glob: step metric}) of the single offline run under `root`.

    finished: the run was closed with run.finish(), so its log ends with an exit record. nanotron 0.4's trainer never
    finishes its run (the process just exits): then wait until the log stops growing instead."""
    files = list(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    # wandb's service process may still be writing the log after run.finish() returned (seen on a loaded machine:
    # a 7-byte file).
    deadline, size, stable_since = time.monotonic() + 60, -1, time.monotonic()
    while True:
        if finished and any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(files[0])):
            break
        if not finished:
            now_size = files[0].stat().st_size
            if now_size != size:
                size, stable_since = now_size, time.monotonic()
            elif time.monotonic() - stable_since > 2:
                break
        assert time.monotonic() < deadline, f"{files[0]} has no exit record after 60 s"
        time.sleep(0.1)
    rows, step_metrics = [], {}
    for r in read_wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "metric":
            step_metrics[r.metric.name or r.metric.glob_name] = r.metric.step_metric
    return rows, step_metrics


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    yield
    if wandb.run is not None:  # never leak a run into the next test
        wandb.run.finish()


def test_hook_opens_offline_run_and_logs_on_training_step_axis(toy_backend, tmp_path):
    config = EvalHookConfig(tasks=TASKS, every_n_steps=2, max_samples=3, output_dir=tmp_path,
                            wandb_project="nano_eval_test", wandb_mode="offline", wandb_run_name="hook-test")
    hook = EvalHook(config, toy_backend)
    assert hook.wandb.owns_run
    for step in range(1, 7):
        hook.maybe_evaluate(step, consumed_tokens=100 * step)
    hook.close()
    assert wandb.run is None  # the hook finished the run it opened

    rows, step_metrics = read_run(tmp_path)
    assert step_metrics["eval/*"] == "train/step" and step_metrics["train/consumed_tokens"] == "train/step"
    eval_rows = [r for r in rows if "eval/demo|arithmetic|0/acc" in r]
    assert [r["train/step"] for r in eval_rows] == [2, 4, 6]
    assert [r["train/consumed_tokens"] for r in eval_rows] == [200, 400, 600]
    local = read_jsonl(tmp_path / "eval_results.jsonl")
    for row, line in zip(eval_rows, local):
        assert row["eval/demo|arithmetic_ppl|0/bits_per_byte"] == pytest.approx(
            line["results"]["demo|arithmetic_ppl|0"]["bits_per_byte"])
        assert row["eval/time_s"] == pytest.approx(line["time_s"]) and 0 < row["eval/time_share"] <= 1
        assert "eval/demo|arithmetic|0/acc_stderr" not in row  # stderr stays in the local files unless asked


def test_hook_logs_into_the_trainers_run_without_dropping_its_rows(toy_backend, tmp_path):
    run = wandb.init(project="nano_eval_test", dir=str(tmp_path), mode="offline")
    hook = EvalHook(EvalHookConfig(tasks=TASKS, every_n_steps=3, max_samples=2, output_dir=tmp_path), toy_backend)
    assert hook.wandb.run is run and not hook.wandb.owns_run
    for step in range(1, 10):
        wandb.log({"train/loss": 1.0 / step}, step=step)  # a trainer that passes step= explicitly
        hook.maybe_evaluate(step)
    hook.close()
    assert wandb.run is run  # the trainer's run stays open
    run.finish()

    rows, step_metrics = read_run(tmp_path)
    assert step_metrics["eval/*"] == "train/step"
    assert [r["_step"] for r in rows if "train/loss" in r] == list(range(1, 10))  # every trainer row kept
    assert [r["train/step"] for r in rows if "eval/demo|arithmetic|0/acc" in r] == [3, 6, 9]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("nano_eval: warning:")]


def test_wandb_that_cannot_start_warns_once_and_local_results_stay_intact(toy_backend, tmp_path, capsys):
    config = EvalHookConfig(tasks=TASKS, every_n_steps=1, max_samples=2, output_dir=tmp_path,
                            wandb_project="nano_eval_test", wandb_mode="no-such-mode")  # wandb.init rejects it
    with EvalHook(config, toy_backend) as hook:
        for step in range(1, 4):
            assert hook.maybe_evaluate(step) is not None
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and "W&B could not start" in warnings[0]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval_results.jsonl")] == [1, 2, 3]


def test_failing_wandb_log_warns_once_and_local_results_stay_intact(toy_backend, tmp_path, capsys, monkeypatch):
    config = EvalHookConfig(tasks=TASKS, every_n_steps=1, max_samples=2, output_dir=tmp_path,
                            wandb_project="nano_eval_test", wandb_mode="offline")
    hook = EvalHook(config, toy_backend)

    def broken_log(*args, **kwargs):
        raise ConnectionError("simulated W&B outage")

    # A monkeypatch: an upload/quota failure cannot be caused for real in an offline run.
    monkeypatch.setattr(hook.wandb.run, "log", broken_log)
    for step in range(1, 4):
        assert hook.maybe_evaluate(step) is not None
    monkeypatch.undo()
    hook.close()
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and "W&B logging failed at step 1" in warnings[0] and hook.wandb.failures == 3
    assert [r["step"] for r in read_jsonl(tmp_path / "eval_results.jsonl")] == [1, 2, 3]


def test_missing_wandb_and_tensorboard_are_one_warning_each(toy_backend, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as if not installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    config = EvalHookConfig(tasks=TASKS, every_n_steps=1, max_samples=2, output_dir=tmp_path,
                            wandb_project="nano_eval_test", tensorboard_dir=str(tmp_path / "tb"))
    with EvalHook(config, toy_backend) as hook:
        for step in range(1, 3):
            hook.maybe_evaluate(step)
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 2
    assert "wandb is not installed" in warnings[0] and "TensorBoard logging skipped" in warnings[1]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval_results.jsonl")] == [1, 2]
