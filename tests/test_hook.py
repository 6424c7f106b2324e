"""The in-training evaluation hook: training is bitwise unchanged, the schedule, the time budget, failures.

The failure tests inject errors with a test-only backend subclass whose forward raises while `broken` is set
(standing in for an OOM or a bug during evaluation), and with a real unwritable results file on rank 0.
"""

import json
import random

import numpy as np
import pytest
import torch

from nano_eval.backends.transformers import TransformersModel
from nano_eval.tracking.jsonl import append_jsonl, read_jsonl
from nano_eval.training.config import EvalHookConfig
from nano_eval.training.hook import EvalHook, EvalHookError
from tests.dist_utils import run_distributed

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3"


class FlakyBackend(TransformersModel):
    """Test-only: forward raises while `broken` is set."""

    broken = False

    def forward(self, batch):
        if self.broken:
            raise RuntimeError("injected forward failure")
        return super().forward(batch)


def _load(ckpt, dropout: float = 0.0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout  # dropout makes every step draw from torch's RNG
    return model, tokenizer


def _train(ckpt, steps, hook_config=None, perturb_rng=False):
    """A toy training loop whose data comes from python's and numpy's RNGs and whose dropout uses torch's RNG.
    The hook runs between backward and the optimizer step, while gradients are live."""
    from nano_eval.toy import arithmetic_line

    model, tokenizer = _load(ckpt, dropout=0.2)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hook = EvalHook.for_transformers(hook_config, model, tokenizer) if hook_config else None
    model.train()
    losses, tokens = [], 0
    for step in range(1, steps + 1):
        lines = [arithmetic_line(random.randrange(10), random.randrange(10)) for _ in range(np.random.randint(2, 6))]
        enc = tokenizer(lines, return_tensors="pt", padding=True)
        loss = model(**enc, labels=enc.input_ids.masked_fill(enc.attention_mask == 0, -100)).loss
        loss.backward()
        tokens += int(enc.attention_mask.sum())
        if hook is not None:
            hook.maybe_evaluate(step, consumed_tokens=tokens)
            assert model.training and all(m.training for m in model.modules())
        if perturb_rng:
            torch.rand(1)  # what a leak of one RNG draw would do
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if hook is not None:
        hook.close()
    return losses, model, opt, hook


def test_training_is_bitwise_identical_with_and_without_the_hook(toy_checkpoint, tmp_path):
    config = EvalHookConfig(tasks=TASKS, every_n_steps=2, max_samples=4, output_dir=tmp_path / "out",
                            wandb_project="nano_eval_test", wandb_mode="offline", wandb_dir=str(tmp_path))
    losses_off, model_off, opt_off, _ = _train(toy_checkpoint, 5)
    losses_on, model_on, opt_on, hook = _train(toy_checkpoint, 5, config)
    losses_leak, _, _, _ = _train(toy_checkpoint, 5, perturb_rng=True)

    assert hook.evaluated_steps == [2, 4] and hook.failed_steps == []
    assert losses_on == losses_off  # exact floats
    for p_off, p_on in zip(model_off.parameters(), model_on.parameters()):
        assert torch.equal(p_off, p_on)
    for s_off, s_on in zip(opt_off.state.values(), opt_on.state.values()):
        assert all(torch.equal(s_off[k], s_on[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert losses_leak != losses_off  # the comparison is sensitive: one stray RNG draw changes the losses
    rows = read_jsonl(tmp_path / "out" / "eval_results.jsonl")
    assert [r["step"] for r in rows] == [2, 4] and rows[1]["consumed_tokens"] > rows[0]["consumed_tokens"] > 0


def test_should_run_schedule(toy_backend, tmp_path):
    hook = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", every_n_steps=3, also_at_steps=[1, 4], max_samples=1,
                                   output_dir=tmp_path), toy_backend)
    assert [s for s in range(0, 13) if hook.should_run(s)] == [1, 3, 4, 6, 9, 12]
    assert hook.maybe_evaluate(2) is None and hook.maybe_evaluate(3).step == 3
    assert not hook.should_run(3)  # once per step, even if the loop asks again
    never = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", max_samples=1, output_dir=tmp_path), toy_backend)
    assert not any(never.should_run(s) for s in range(100))
    with pytest.raises(ValueError, match="every_n_steps"):
        EvalHookConfig(tasks="demo|arithmetic|0", every_n_steps=0)


def test_results_files(toy_backend, tmp_path):
    hook = EvalHook(EvalHookConfig(tasks=TASKS, max_samples=3, output_dir=tmp_path, write_details=True), toy_backend)
    results = hook(7, consumed_tokens=1234)
    doc = json.loads((tmp_path / "step_7" / "results.json").read_text())
    row = read_jsonl(tmp_path / "eval_results.jsonl")[0]
    assert doc["step"] == row["step"] == 7 and row["consumed_tokens"] == 1234 and row["time_s"] > 0
    assert row["results"] == doc["results"] == {k: tr.metrics for k, tr in results.tasks.items()}
    assert set(row["results"]) == {"demo|arithmetic|0", "demo|arithmetic_gen|3"} and row["skipped_tasks"] == []
    assert (tmp_path / "step_7" / "details" / "demo_arithmetic_0.jsonl").exists()
    assert 0 < row["time_share"] <= 1
    assert set(hook.flat_metrics(results)) >= {"eval/demo|arithmetic|0/acc", "eval/demo|arithmetic_gen|3/exact_match"}


def test_a_rerun_replaces_the_log_rows_of_the_run_it_replaces(toy_backend, tmp_path):
    """Rerunning a training script (fresh, or resumed at step S) never duplicates eval_results.jsonl rows."""
    def run(steps):
        hook = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", max_samples=1, output_dir=tmp_path), toy_backend)
        for step in steps:
            hook(step)
        hook.close()
        return [r["step"] for r in read_jsonl(tmp_path / "eval_results.jsonl")]

    assert run([2, 4, 6]) == [2, 4, 6]
    assert run([2, 4, 6]) == [2, 4, 6]  # a fresh run starts a fresh log
    assert run([4, 8]) == [2, 4, 8]  # resumed at step 4: the old run's rows from step 4 on are replaced


def test_jsonl_reader_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"step": 1, "x": float("nan")})
    append_jsonl(path, {"step": 2})
    with path.open("a") as f:
        f.write('{"step": 3, "res')  # a kill in the middle of a write
    assert read_jsonl(path) == [{"step": 1, "x": None}, {"step": 2}]


def test_time_budget_skips_tasks_says_so_and_rotates(toy_backend, tmp_path):
    tasks = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
    a, b, c = tasks.split(",")
    # Budget 0: each evaluation scores one task (a started task always finishes), then skips the rest.
    hook = EvalHook(EvalHookConfig(tasks=tasks, max_samples=2, time_budget_s=0.0, output_dir=tmp_path), toy_backend)
    seen = [hook(step) for step in (1, 2, 3, 4)]
    assert [list(r.tasks) for r in seen] == [[a], [b], [c], [a]]
    assert [r.skipped_tasks for r in seen] == [[b, c], [c, a], [a, b], [b, c]]
    rows = read_jsonl(tmp_path / "eval_results.jsonl")
    assert [r["skipped_tasks"] for r in rows] == [r.skipped_tasks for r in seen]
    assert json.loads((tmp_path / "step_2" / "results.json").read_text())["skipped_tasks"] == [c, a]
    # The same task scores the same whether or not others were skipped.
    full = EvalHook(EvalHookConfig(tasks=tasks, max_samples=2, time_budget_s=1e9, output_dir=tmp_path / "full"),
                    toy_backend)(1)
    assert full.skipped_tasks == [] and list(full.tasks) == [a, b, c]
    assert full.tasks[b].metrics == seen[1].tasks[b].metrics


def test_fail_soft_reports_once_and_training_goes_on(toy_checkpoint, tmp_path, capsys):
    model, tokenizer = _load(toy_checkpoint)
    backend = FlakyBackend(model, tokenizer)
    hook = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", every_n_steps=2, max_samples=2, output_dir=tmp_path),
                    backend)
    returned = {}
    for step in range(1, 9):
        backend.broken = step in (4, 6)
        returned[step] = hook.maybe_evaluate(step)
    err = capsys.readouterr().err
    assert [s for s, r in returned.items() if r is not None] == [2, 8]
    assert hook.failed_steps == [4, 6] and hook.evaluated_steps == [2, 8]
    assert err.count("evaluation at step 4 failed on rank 0: RuntimeError: injected forward failure") == 1
    assert err.count("evaluation at step 6 failed on rank 0") == 1
    assert err.count("Traceback (most recent call last)") == 1  # full traceback once, not per failure
    rows = read_jsonl(tmp_path / "eval_results.jsonl")  # failed steps leave a `failed` row (test_faults.py)
    assert [(r["step"], "results" in r, "injected" in r.get("failed", "")) for r in rows] == [
        (2, True, False), (4, False, True), (6, False, True), (8, True, False)]


def test_bad_task_spec_fails_at_build(toy_backend, tmp_path):
    from nano_eval.errors import NanoEvalError

    with pytest.raises(NanoEvalError, match="no_such_task"):
        EvalHook(EvalHookConfig(tasks="demo|no_such_task|0", output_dir=tmp_path), toy_backend)


def _two_rank_failures(rank, world, ckpt, out):
    """Both ranks run the same calls; failures happen on rank 0 only (its results file cannot be written) or on
    every rank (forward raises). Returns what each rank saw."""
    import os

    import torch.distributed as dist

    model, tokenizer = _load(ckpt)
    backend = FlakyBackend(model, tokenizer)
    seen = {}
    for fail_soft in (True, False):
        out_dir = os.path.join(out, f"soft_{fail_soft}")
        hook = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", max_samples=4, output_dir=out_dir,
                                       fail_soft=fail_soft), backend)
        for step, where in ((1, None), (2, "rank0_publish"), (3, "forward_all_ranks"), (4, None)):
            blocked = os.path.join(out_dir, "eval_results.jsonl")
            if where == "rank0_publish" and rank == 0:  # a real failure on rank 0 only: the results file is a dir
                os.rename(blocked, blocked + ".aside")
                os.makedirs(blocked)
            backend.broken = where == "forward_all_ranks"
            try:
                r = hook(step)
                seen[(fail_soft, step)] = "ok" if r is not None else "none"
            except EvalHookError as e:
                seen[(fail_soft, step)] = f"raised: {e}"
            if where == "rank0_publish" and rank == 0:
                os.rmdir(blocked)
                os.rename(blocked + ".aside", blocked)
        hook.close()
    t = torch.ones(1)
    dist.all_reduce(t)  # the process group still works: nobody is stuck in a collective
    seen["alive"] = t.item()
    return seen


def test_failures_are_agreed_by_all_ranks(toy_checkpoint, tmp_path):
    per_rank = run_distributed(_two_rank_failures, 2, str(toy_checkpoint), str(tmp_path), timeout=150)
    for seen in per_rank:
        assert seen["alive"] == 2
        assert [seen[(True, s)] for s in (1, 2, 3, 4)] == ["ok", "none", "none", "ok"]
        assert seen[(False, 1)] == seen[(False, 4)] == "ok"
        assert seen[(False, 2)].startswith("raised: evaluation at step 2 failed on rank 0: LocalFileError")
        assert seen[(False, 3)].startswith(
            "raised: evaluation at step 3 failed on ranks 0, 1 (first: rank 0): RuntimeError: injected forward")
    assert per_rank[0] == per_rank[1]  # every rank took the same branch with the same message
    # step 2 could not write even its `failed` row (the JSONL file was a folder); step 3 left one
    rows = read_jsonl(tmp_path / "soft_True" / "eval_results.jsonl")
    assert [(r["step"], "failed" in r) for r in rows] == [(1, False), (3, True), (4, False)]


def test_per_task_sample_caps(toy_backend, tmp_path):
    config = EvalHookConfig(tasks=TASKS, every_n_steps=1, max_samples=3, output_dir=tmp_path,
                            max_samples_per_task={"demo|arithmetic_gen": 2})
    results = EvalHook(config, toy_backend)(1)
    assert {k: tr.num_docs for k, tr in results.tasks.items()} == {"demo|arithmetic|0": 3, "demo|arithmetic_gen|3": 2}
    with pytest.raises(ValueError, match="names no evaluated task: demo|arithmetc"):
        EvalHook(EvalHookConfig(tasks=TASKS, max_samples_per_task={"demo|arithmetc": 2}, output_dir=tmp_path),
                 toy_backend)
