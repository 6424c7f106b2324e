"""A fault on one rank outside the model's forwards ends the evaluation on every rank together, fast
(nano_eval/agreement.py).

Seen before: in the training hook with fail_soft=True one rank raised while detokenising mid-generation; the other
waited out the whole process-group timeout in its next collective, then returned None on one run and crashed on
another (under lockstep both crashed: the failing rank's "did anyone fail?" all-reduce met the other's lockstep
all-reduce). With NCCL that timeout is ten minutes and ends the process: one rank's bad document killed training.

Here every world runs with a 60 s process-group timeout and a fault is injected on rank 1 only (the tokenizer's
decode mid-generation, the scoring of a batch, a metric); every rank must end within a few seconds with the same
outcome (fail_soft=True: None; False: EvalHookError naming rank 1 and its message), and the process groups must still
be in step afterwards (an all-reduce, a training-like forward, a clean evaluation that agrees on every rank).
Dense data parallel (transformers on gloo), the same forced into lockstep (the MoE schedule), the command line
launched as torchrun launches it (default suite); a sweep, and megatron-core's MoE GPTModel at ep2 (lockstep) and at
pp2 (two pipeline stages: only the output stage scores) in the slow set.
"""

import os
import subprocess
import sys
import time

import pytest

from tests.dist_utils import free_port, run_distributed

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|0"
PG_TIMEOUT_S = 60
FAST_S = PG_TIMEOUT_S / 2  # far below the process-group timeout, with room for a loaded shared CPU


class _Fault:
    """Make `obj.name` raise `error` on `rank` from its `after`-th call on (a no-op on the other ranks)."""

    def __init__(self, obj, name: str, rank: int, error: Exception, after: int = 3):
        import torch.distributed as dist

        self.obj, self.name, self.calls = obj, name, 0
        self.original = getattr(obj, name)
        if dist.get_rank() != rank:
            return

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls >= after:
                raise error
            return self.original(*args, **kwargs)

        object.__setattr__(obj, name, failing)  # frozen dataclasses (a Metric) too

    def undo(self):
        object.__setattr__(self.obj, self.name, self.original)


def _training_step_sum(model, ids) -> float:
    """A training-like step every rank takes after the evaluation: a forward, then an all-reduce of its loss."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        loss = model(ids, labels=ids).loss.detach().reshape(1)
    dist.all_reduce(loss)
    return float(loss)


def _hook_world(rank, world, ckpt, out):
    """The toy transformers model, dense data parallel and forced into lockstep (_hook_cases); a metric failing on
    rank 1 only; then the training-like step."""
    import torch

    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    backend = load_transformers(ckpt)
    ids = torch.arange(3, 19).reshape(1, 16)
    seen = {"step_before": _training_step_sum(backend.module, ids)}
    for lockstep, cases in DENSE_CASES.items():
        backend.lockstep = lockstep  # the schedule MoE models run (nano_eval.lockstep), forced on the dense model
        seen[lockstep] = _hook_cases(backend, f"{out}/lockstep_{lockstep}", cases, scoring_after=1)
    # a metric failing on rank 1 only: the task is failed on every rank, the other task scored alike
    hook = EvalHook(EvalHookConfig(tasks=TASKS, max_samples=6, output_dir=f"{out}/metric", wandb=False,
                                   progress=False), backend)
    task = hook._evaluators[0].prepared[0].task
    fault = _Fault(task.metrics[0], "compute", 1, ZeroDivisionError("injected metric failure"), after=1)
    results = hook(1)
    fault.undo()
    seen["metric"] = (sorted(results.failed.items()), sorted(results.tasks), hook.specs[0].key)
    seen["step_after"] = _training_step_sum(backend.module, ids)
    return seen


# lockstep: [(fault, fail_soft)]: both schedules, both fault places, both fail_soft answers
DENSE_CASES = {False: [("decode", True), ("scoring", False)], True: [("decode", False), ("scoring", True)]}
# the failing rank's message (a decoder's error is the tokenizer's refusal, naming the tokenizer and the fix)
MESSAGES = {"decode": "fails when decoding (RuntimeError: injected decode failure)",
            "scoring": "ValueError: injected scoring failure"}


def check_cases(per_rank: list[dict], cases: list, scoring_after: int = 2) -> None:
    """Every rank: the same outcome of each case (None under fail_soft, else EvalHookError naming rank 1 and its
    message), far within the process group's timeout, the fault reached mid-run; the same clean scores after."""
    for rank, seen in enumerate(per_rank):
        for step, case in enumerate(cases, start=1):
            outcome, took, calls = seen[case]
            if rank == 1:
                assert calls >= (5 if case[0] == "decode" else scoring_after), (case, calls)  # it came mid-run
            if case[1]:
                assert outcome == "none", (rank, case)
            else:
                assert outcome.startswith(f"raised: evaluation at step {step} failed on rank 1: "), (rank, outcome)
                assert MESSAGES[case[0]] in outcome, (rank, outcome)
            assert took < FAST_S, (rank, case, took)
    assert per_rank[0]["clean"] == per_rank[1]["clean"] and len(per_rank[0]["clean"]) == 2


def test_hook_faults_on_one_rank_end_every_rank_together(toy_checkpoint, tmp_path):
    per_rank = run_distributed(_hook_world, 2, str(toy_checkpoint), str(tmp_path), timeout=240,
                               pg_timeout_s=PG_TIMEOUT_S)
    for lockstep, cases in DENSE_CASES.items():
        check_cases([seen[lockstep] for seen in per_rank], cases, scoring_after=1)
    for seen in per_rank:
        failed, scored, key = seen["metric"]
        assert failed == [(key, "on rank 1: ZeroDivisionError: injected metric failure")] and key not in scored
        # the process groups are still in step: the training-like step (a forward, an all-reduce) matches
        assert seen["step_after"] == seen["step_before"] == per_rank[0]["step_before"]


PATCH_DECODE = '''
import os
from transformers import PreTrainedTokenizerBase
from nano_eval.errors import NanoEvalError

TASKS_TABLE = []
if os.environ.get("RANK") == "1":  # rank 1 fails while detokenising, mid-generation
    _decode, _calls = PreTrainedTokenizerBase.decode, [0]

    def decode(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] >= 5:
            raise NanoEvalError("document 3 cannot be detokenised (injected). Fix: nothing, it is a test")
        return _decode(self, *args, **kwargs)

    PreTrainedTokenizerBase.decode = decode
'''


def _two_ranks(args: list[str], tmp_path) -> tuple[list[int], list[str], float]:
    """`python -m nano_eval ARGS` as two ranks started the way torchrun starts them (its environment variables; no
    torchrun to kill the survivor), with rank 1's decode failing (PATCH_DECODE as the custom tasks). Returns the exit
    codes, the logs and how far apart the two ranks ended (seconds)."""
    custom = tmp_path / "fault.py"
    custom.write_text(PATCH_DECODE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "nano_eval", *args, "--custom-tasks", str(custom), "--dist-timeout", str(PG_TIMEOUT_S)]
    logs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r, log in enumerate(logs)]
    ended: dict[int, float] = {}
    try:
        deadline = time.monotonic() + PG_TIMEOUT_S + 240
        while len(ended) < 2 and time.monotonic() < deadline:
            ended.update((r, time.monotonic()) for r, p in enumerate(procs) if r not in ended and p.poll() is not None)
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    assert len(ended) == 2, texts
    return codes, texts, abs(ended[0] - ended[1])


def _error_lines(texts: list[str]) -> list[str]:
    return [line for text in texts for line in text.splitlines() if line.startswith("nano_eval: error:")]


INJECTED = "the evaluation failed on rank 1: document 3 cannot be detokenised (injected). Fix: nothing, it is a test"


def test_cli_fault_on_one_rank_ends_both_ranks_with_one_line(toy_checkpoint, tmp_path):
    """Rank 1 raises mid-generation: both exit 2 at once and one `nano_eval: error:` line names rank 1."""
    codes, texts, apart = _two_ranks(["--checkpoint", str(toy_checkpoint), "--tasks", "demo|arithmetic_gen|0",
                                      "--max-samples", "6", "--output-dir", str(tmp_path / "out")], tmp_path)
    assert codes == [2, 2], texts
    assert _error_lines(texts) == [f"nano_eval: error: {INJECTED}"], texts
    assert not (tmp_path / "out" / "results.json").exists()
    assert apart < FAST_S, apart  # rank 0 did not wait out the 60 s timeout


@pytest.mark.slow  # evaluate_checkpoint, the part a sweep shares with the command line, is in the default suite
def test_sweep_fault_on_one_rank_fails_the_checkpoint_on_both_and_goes_on(tmp_path):
    """A sweep of two checkpoints with rank 1 failing mid-generation on each: both ranks record each checkpoint as
    failed and go on to the next (no timeout, process group still in step), and exit 1 at the end."""
    from tests.sweep_utils import train_run_dir

    train_run_dir(tmp_path / "run", saves=2, steps_per_save=2)
    codes, texts, apart = _two_ranks(["sweep", str(tmp_path / "run"), "--tasks", "demo|arithmetic_gen|0",
                                      "--max-samples", "6", "--output-dir", str(tmp_path / "out"), "--settle-s", "0",
                                      "--no-report"], tmp_path)
    assert codes == [1, 1], texts
    failed = [line for line in _error_lines(texts) if line.startswith("nano_eval: error: checkpoint ")]
    assert [line.split(" (step ")[1].split(")")[0] for line in failed] == ["2", "4"], texts
    assert all(line.endswith(f"failed: {INJECTED}; skipped, the sweep goes on") for line in failed), failed
    assert apart < FAST_S, apart


def _hook_cases(backend, out: str, cases, scoring_after: int = 2) -> dict:
    """Per (fault, fail_soft) of `cases`: (outcome, seconds, the fault's calls on rank 1) of a hook call with that
    fault on rank 1 (detokenising from its 5th call, mid-generation; scoring from its `scoring_after`-th batch);
    then "clean": the scores of a call without one."""
    import nano_eval.engine as engine
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook, EvalHookError

    hooks = {soft: EvalHook(EvalHookConfig(tasks=TASKS, max_samples=7, batch_tokens=32, fail_soft=soft,
                                           output_dir=f"{out}/soft_{soft}", wandb=False, progress=False), backend)
             for soft in (True, False)}
    faults = {
        "decode": lambda: _Fault(backend.tokenizer, "decode", 1, RuntimeError("injected decode failure"), after=5),
        "scoring": lambda: _Fault(engine, "split_scores", 1, ValueError("injected scoring failure"),
                                    after=scoring_after),
    }
    seen = {}
    for step, (where, soft) in enumerate(cases, start=1):
        fault = faults[where]()
        start = time.perf_counter()
        try:
            outcome = "none" if hooks[soft](step) is None else "results"
        except EvalHookError as e:
            outcome = f"raised: {e}"
        finally:
            fault.undo()
        seen[(where, soft)] = (outcome, time.perf_counter() - start, fault.calls)
    seen["clean"] = {k: tr.metrics for k, tr in hooks[True](len(cases) + 1).tasks.items()}
    return seen


def _moe_world(rank, world, tokenizer_dir, out):
    """megatron-core's MoE GPTModel at ep2 (dp2, alltoall, capacity factor: lockstep): rank 1 fails while
    detokenising mid-generation (fail_soft True and False) and while scoring; then a training-mode forward (the
    experts' all-to-all) gives bitwise what it gave before. Then the same model at pp2 (one replica, two stages;
    rank 1 is the output stage, the only one that scores): the stages end together too."""
    import torch
    import torch.distributed as dist

    from tests.megatron_moe_worker import CAPACITY, moe_backend

    backend = moe_backend(tokenizer_dir, ep=2, capacity=CAPACITY, pad_to_capacity=True)
    model = backend.chunks[0]
    ids = torch.randint(0, 544, (2, 16), generator=torch.Generator().manual_seed(7))

    def training_forward():
        model.train()
        with torch.enable_grad():
            out = model(ids, torch.arange(16).expand(2, 16), None).detach().clone()
        total = out.sum().reshape(1)
        dist.all_reduce(total)
        return out, float(total)

    before = training_forward()
    # scoring fails from rank 1's first batch: packed rows put these requests in one or two batches per rank
    seen = {"ep2": _hook_cases(backend, f"{out}/ep2", MOE_CASES["ep2"], scoring_after=1) | {"lockstep": backend.lockstep}}
    after = training_forward()
    seen["ep2"]["training_forward_bitwise"] = torch.equal(before[0], after[0])
    seen["ep2"]["all_reduced"] = (before[1], after[1])
    backend = moe_backend(tokenizer_dir, pp=2)
    seen["pp2"] = _hook_cases(backend, f"{out}/pp2", MOE_CASES["pp2"], scoring_after=1) | {"lockstep": backend.lockstep}
    return seen


MOE_CASES = {"ep2": [("decode", True), ("decode", False), ("scoring", True)],
             "pp2": [("scoring", False), ("decode", True)]}


@pytest.mark.slow
def test_moe_ep2_and_pp2_faults_on_one_rank_end_every_rank_together(toy_checkpoint, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    per_rank = run_distributed(_moe_world, 2, str(toy_checkpoint), str(tmp_path), timeout=900,
                               pg_timeout_s=PG_TIMEOUT_S)
    for name, cases in MOE_CASES.items():
        assert [seen[name]["lockstep"] for seen in per_rank] == [name == "ep2"] * 2
        check_cases([seen[name] for seen in per_rank], cases, scoring_after=1)
    for seen in per_rank:  # the experts' all-to-all and an all-reduce after the failed evaluations: as before
        assert seen["ep2"]["training_forward_bitwise"] and len(set(seen["ep2"]["all_reduced"])) == 1
