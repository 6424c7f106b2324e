"""Fuzz what nano_eval reads around a checkpoint: a `--data-dir` mirror and a tasks file (tests/checkpoint_fuzz.py
does the checkpoints themselves).

    python -m tests.surroundings_fuzz WORK_DIR REPORT.json [--seed S] [--cases N]

Runs in its own process, under an address-space limit (its size after imports + 4 GiB) and a per-case alarm. Every
case builds a genuine mirror of one layout (`<split>.jsonl`, `<split>.parquet` or a `save_to_disk` folder, as
`datasets` writes them) and a genuine tasks file, applies one seeded mutation (byte flips, truncation, a symlink out
of the mirror or to another file inside, a FIFO, a state.json or dataset_dict.json edit, a parquet footer or Arrow
header flip that declares other sizes, a hostile JSON line, a non-ASCII digit or a flip in the tasks file) and loads
the tasks as `nano_eval` would before touching a model (`load_tasks`, then the requests of the first 4 documents).

Each case ends as one of:
  refused    a NanoEvalError (what the command line prints as one line, exit code 2)
  same       loaded, and the documents equal the genuine mirror's
  different  loaded other documents (a flip inside a value: the formats have no checksums)
  outside    a byte of the file outside the mirror reached a document or a message             -> defect
  memory     an allocation failed (the loader tried to allocate past its limit)                 -> defect
  crash      anything else escaped                                                              -> defect
  timeout    the case did not end within its alarm                                              -> defect
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from tests.fuzz_case import cap_memory, run_case

CASE_ALARM_S = 60
CAP_BYTES = 4 << 30
SECRET = "SECRET-OUTSIDE-5e2a"
SPEC = "custom|bench|0"
TASKS_FILE = '''
from nano_eval.tasks import TaskConfig
from nano_eval.tasks.demo_tasks import arithmetic_choice

TASKS_TABLE = [TaskConfig(name="bench", prompt_function=arithmetic_choice, hf_repo="org/bench", hf_subset=None,
                          metrics=("acc",), evaluation_splits=("test",), few_shots_split="test", suite=("custom",))]
'''
LAYOUTS = ("jsonl", "parquet", "save_to_disk")




# ---- the genuine surroundings -------------------------------------------------------------------------------------

def genuine_rows() -> list[dict]:
    from nano_eval.tasks.demo_tasks import DATA

    return [json.loads(line) for line in (DATA / "arithmetic.jsonl").read_text().splitlines()][:16]


def build(case: Path, layout: str, rows: list[dict]) -> dict:
    """A mirror of `layout`, a folder outside it holding secret data of every format, and a specs file."""
    import datasets

    mirror, outside = case / "mirror", case / "outside"
    base = mirror / "org" / "bench" / "none"
    base.mkdir(parents=True)
    secret_rows = [{"a": 1, "b": 1, "choices": [SECRET, "2"], "label": 1}] * 4
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(secret_rows).save_to_disk(str(outside / "saved"))
    (outside / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in secret_rows))
    datasets.Dataset.from_list(secret_rows).to_parquet(str(outside / "test.parquet"))
    if layout == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(base / "test"))
    elif layout == "jsonl":
        (base / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(base / "test.parquet"))
    (case / "tasks.py").write_text(TASKS_FILE)
    (case / "specs.txt").write_text(f"# specs\n{SPEC}\n")
    return {"mirror": mirror, "base": base, "outside": outside, "specs": case / "specs.txt", "layout": layout}


def data_files(world: dict) -> list[Path]:
    return sorted(p for p in world["base"].rglob("*") if p.is_file())


# ---- mutations ----------------------------------------------------------------------------------------------------

def flip(world, rng, path=None) -> str:
    path = path or rng.choice(data_files(world))
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip {path.name} (empty)"
    region = rng.choice(["anywhere", "head", "tail"])  # head: Arrow schema / JSON start; tail: parquet footer
    where = []
    for _ in range(rng.randint(1, 4)):
        span = {"anywhere": (0, len(data)), "head": (0, min(len(data), 512)),
                "tail": (max(0, len(data) - 512), len(data))}[region]
        i = rng.randrange(*span)
        data[i] ^= 1 << rng.randrange(8)
        where.append(i)
    path.write_bytes(bytes(data))
    return f"flip {path.name} at {where} ({region})"


def truncate(world, rng, path=None) -> str:
    path = path or rng.choice(data_files(world))
    data = path.read_bytes()
    cut = rng.randrange(0, max(1, len(data)))
    path.write_bytes(data[:cut])
    return f"truncate {path.name} at {cut}/{len(data)}"


def link_out(world, rng) -> str:
    """A file or folder of the mirror replaced by a symlink to its counterpart outside (secret rows)."""
    path = rng.choice(data_files(world) + [world["base"], world["base"] / "test"])
    if not path.exists():
        path = rng.choice(data_files(world))
    outside = world["outside"]
    target = {".jsonl": outside / "test.jsonl", ".parquet": outside / "test.parquet"}.get(path.suffix)
    if path == world["base"]:
        target = outside
    elif path.name == "test" and path.is_dir():
        target = outside / "saved"
    elif target is None:
        target = next((outside / "saved").glob(path.name), None) or next((outside / "saved").glob("*.arrow"))
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.symlink_to(target, target_is_directory=target.is_dir())
    return f"link {path.relative_to(world['mirror'])} -> outside {target.name}"


def link_inside(world, rng) -> str:
    """A data file moved elsewhere inside the mirror and linked back (a mirror sharing a copy): must still load."""
    path = rng.choice(data_files(world))
    shared = world["mirror"] / "shared" / f"{rng.randrange(1 << 30)}_{path.name}"
    shared.parent.mkdir(exist_ok=True)
    path.rename(shared)
    path.symlink_to(os.path.relpath(shared, path.parent))
    return f"link {path.name} -> inside {shared.name}"


def fifo(world, rng) -> str:
    path = rng.choice(data_files(world))
    path.unlink()
    os.mkfifo(path)
    return f"fifo {path.name}"


STATE_NAMES = ["../../../../outside/saved/data-00000-of-00001.arrow", "/etc/passwd", "", ".", "..", "sub/x.arrow",
               "a\nb.arrow", 5, None, "x" * 5000, "data-00000-of-00001.arrow\x00", "missing.arrow"]


def edit_state(world, rng) -> str:
    """state.json (save_to_disk) or the data file's first line: a value replaced by a hostile one."""
    if world["layout"] != "save_to_disk":
        return hostile_line(world, rng)
    path = world["base"] / "test" / "state.json"
    state = json.loads(path.read_text())
    choice = rng.randrange(4)
    if choice == 0:
        state["_data_files"] = [{"filename": rng.choice(STATE_NAMES)}]
    elif choice == 1:
        state["_data_files"].append({"filename": rng.choice(STATE_NAMES)})
    elif choice == 2:
        state["_data_files"] = rng.choice([None, "x.arrow", {}, [], [["x"]], 10 ** 30])
    else:
        path.write_text(rng.choice(["[" * 50000, "{}", "null", "\ufeff{}", json.dumps(state) + "x" * (2 << 20)]))
        return f"state.json replaced ({choice})"
    path.write_text(json.dumps(state))
    return f"state.json _data_files -> {json.dumps(state['_data_files'])[:80]}"


def dataset_dict(world, rng) -> str:
    """A DatasetDict index next to the split folders whose split list names something else."""
    import datasets

    if world["layout"] != "save_to_disk":
        return flip(world, rng)
    test = world["base"] / "test"
    shutil.rmtree(test)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(genuine_rows())}).save_to_disk(str(world["base"]))
    (test / "state.json").unlink()
    splits = rng.choice([["../../../../outside/saved"], ["test", "../x"], "test", [None], ["test"]])
    (world["base"] / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    return f"dataset_dict.json splits -> {splits}"


HOSTILE_LINES = ['{"a": ' + "[" * 100000 + "]" * 100000 + "}", '{"a": 1' + "0" * 5000 + "}", "[1, 2]", '"text"',
                 '{"a": 1e999999, "b": 1, "choices": ["2"], "label": 0}', "\x00\x01", '{"a": "\\ud800"}',
                 '{"a": 0, "b": 0, "choices": ["0"], "label": 99}', '{"a": 0, "b": 0, "choices": [], "label": 0}']


def hostile_line(world, rng) -> str:
    if world["layout"] != "jsonl":
        return truncate(world, rng)
    path = world["base"] / "test.jsonl"
    lines = path.read_text().splitlines()
    line = rng.choice(HOSTILE_LINES)
    lines.insert(rng.randrange(len(lines) + 1), line)
    path.write_text("\n".join(lines) + "\n")
    return f"jsonl line {line[:40]!r}"


def tasks_file(world, rng) -> str:
    path = world["specs"]
    choice = rng.randrange(5)
    if choice == 0:
        return flip(world, rng, path)
    if choice == 1:
        return truncate(world, rng, path)
    if choice == 2:
        path.unlink()
        os.mkfifo(path)
        return "fifo specs.txt"
    if choice == 3:
        digit = rng.choice(["\N{SUPERSCRIPT TWO}", "\N{ARABIC-INDIC DIGIT THREE}", "\N{FULLWIDTH DIGIT ONE}", "-1",
                            "1" * 30, "0x1", " 0 ", "\u0660"])
        path.write_text(f"custom|bench|{digit}\n")
        return f"specs few-shot count {digit!r}"
    path.write_bytes(rng.choice([b"\xff\xfe" * 10, b"#" * (2 << 20) + b"\n" + SPEC.encode(), b"custom|bench|0\x00",
                                 b"custom|bench|0\r\ncustom|bench|0\x1b[2J"]))
    return "specs replaced"


MUTATIONS = [flip, flip, truncate, link_out, link_inside, fifo, edit_state, dataset_dict, hostile_line, tasks_file]


# ---- running cases ------------------------------------------------------------------------------------------------

def docs_of(world: dict, case: Path) -> list:
    """What nano_eval builds from the surroundings before a model is touched: the first 4 documents' requests."""
    from nano_eval.tasks.registry import load_tasks
    from nano_eval.tasks.task import build_requests

    loaded = load_tasks(str(world["specs"]), custom_tasks=str(case / "tasks.py"), data_dir=str(world["mirror"]))
    out = []
    for spec, task in loaded:
        docs, requests = build_requests(task, spec.num_fewshot, max_samples=4)
        out += [repr(d) for d in docs] + [repr(r) for r in requests]
    return out


def case_outcome(world: dict, case: Path, reference: list) -> tuple[str, str]:
    """The case's outcome and message, under the case alarm (tests/fuzz_case.py)."""
    return run_case(lambda: _run_case_once(world, case, reference), CASE_ALARM_S)


def _run_case_once(world: dict, case: Path, reference: list) -> tuple[str, str]:
    from nano_eval.errors import NanoEvalError
    from nano_eval.local_files import single_line

    try:
        got = docs_of(world, case)
        if any(SECRET in x for x in got):
            return "outside", got[0][:300]
        return ("same" if got == reference else "different"), ""
    except NanoEvalError as e:
        text = single_line(str(e))
        if SECRET in text:
            return "outside", text
        return ("memory" if "MemoryError" in text else "refused"), text
    except BaseException as e:  # noqa: BLE001 - the defect the fuzz looks for
        import traceback

        return ("memory" if isinstance(e, MemoryError) else "crash"), "".join(traceback.format_exception(e))[-1500:]


def run(work: Path, seed: int, cases: int) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = genuine_rows()
    references = {}
    for layout in LAYOUTS:
        world = build(work / f"genuine_{layout}", layout, rows)
        references[layout] = docs_of(world, work / f"genuine_{layout}")
    assert references["jsonl"] == references["parquet"] == references["save_to_disk"], "the layouts disagree"
    _, uncap = cap_memory(CAP_BYTES)
    rng = random.Random(seed)
    out = []
    start = time.perf_counter()
    for i in range(cases):
        layout = LAYOUTS[i % len(LAYOUTS)]
        case = work / f"case_{i}"
        world = build(case, layout, rows)
        mutation = rng.choice(MUTATIONS)
        what = mutation(world, rng)
        print(f"case {i} ({layout}): {what}", file=sys.stderr, flush=True)  # the last one, should it kill us
        t0 = time.perf_counter()
        outcome, message = case_outcome(world, case, references[layout])
        out.append({"layout": layout, "mutation": what, "outcome": outcome, "message": message[:500],
                    "seconds": round(time.perf_counter() - t0, 3)})
        shutil.rmtree(case, ignore_errors=True)
    uncap()
    return {"cases": out, "seconds": round(time.perf_counter() - start, 1)}



def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("report", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=60)
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    report = run(a.work, a.seed, a.cases)
    a.report.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
