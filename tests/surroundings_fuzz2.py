"""Fuzz the two surfaces tests/surroundings_fuzz.py leaves out: a checkpoint's tokenizer files, and an output folder
holding an earlier run's results.

    python -m tests.surroundings_fuzz2 {tokenizer,outputs} WORK_DIR REPORT.json [--seed S] [--cases N]

Runs in its own process, under an address-space limit (its size after imports + 4 GiB) and a per-case alarm
(tests/fuzz_case.py), like the other fuzzes.

tokenizer: every case is a copy of the toy checkpoint (nano_eval.toy) whose tokenizer_config.json carries a genuine
chat template, with one seeded mutation: byte flips or truncation of tokenizer.json, tokenizer_config.json,
special_tokens_map.json or generation_config.json; a JSON edit of tokenizer.json (normalizer, pre-tokenizer regex,
added tokens, vocab entries, model type), of the chat template (loops, repetition, recursion, syntax errors, random
character edits) or of eos_token_id; a symlink (out of the checkpoint, or inside it) or a FIFO in place of a file.
The case loads the checkpoint as `nano_eval eval` does (checkpoints.hf.load_transformers: the folder checks,
load_tokenizer and its probe) and builds the evaluator twice (evaluator.Evaluator: the demo arithmetic task's first
4 documents, tokenised, and once more with --use-chat-template: rendered by the template, then tokenised).
  refused    a NanoEvalError (one line, exit code 2)
  same       the same token ids, rendered prompts and EOS ids as the genuine checkpoint
  different  other ones (a flip inside a vocab entry or a template: the files have no checksums)
  memory / crash / timeout                                                                      -> defect

outputs: every case is a sweep output folder (sweep_settings.json, jobs/running.json, checkpoint-8/results.json
and details/*.jsonl, as nano_eval writes them) next to a victim folder, with one seeded mutation: byte flips,
truncation, a JSON type change, a symlink to the victim (for a file or a folder), a FIFO, a sparse 8 GiB file, a
folder in place of a file. The case runs what a restarted sweep does with the folder, in-process: sweep.lock.
check_settings, the launcher's reading of running.json (sweep.launch.LaunchedSweep._read_running), sweep.runner.
finished_identity on the earlier results, then tracking.results.write_results of a new evaluation.
  refused    a NanoEvalError, and the refused file kept as it was
  handled    read (or counted as not done) and the new results written: results.json and details read back
  outside    a byte of the victim folder changed                                                -> defect
  wrong      written results that do not read back, a refused file changed, running.json records read
             that break its schema, an earlier identity that is not a string                    -> defect
  memory / crash / timeout                                                                      -> defect
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from tests.fuzz_case import crash as _crash, fuzz_main, run_cases, snapshot

CASE_ALARM_S = 60
CAP_BYTES = 4 << 30
TASK = "demo|arithmetic|0"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n{% else %}"
            "{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _refused(e: BaseException) -> tuple[str, str]:
    from nano_eval.local_files import single_line

    text = single_line(str(e))
    return ("memory" if "MemoryError" in text else "refused"), text


# ---- shared mutations ---------------------------------------------------------------------------------------------

def flip(path: Path, rng) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip {path.name} (empty)"
    where = []
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        where.append(i)
    path.write_bytes(bytes(data))
    return f"flip {path.name} at {where}"


def truncate(path: Path, rng) -> str:
    data = path.read_bytes()
    cut = rng.randrange(0, max(1, len(data)))
    path.write_bytes(data[:cut])
    return f"truncate {path.name} at {cut}/{len(data)}"


def fifo(path: Path, rng) -> str:
    path.unlink()
    os.mkfifo(path)
    return f"fifo {path.name}"


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    data = edit(data) or data
    path.write_text(json.dumps(data))


# ---- tokenizer surface --------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
REGEXES = [r"\s+", r"(\w|\w|\w|\w|\w|\w)*\d", r"[", r"(?<=a)b", r"\p{L}+|\p{N}", r"", r"(a*)*$", "." * 3000]
TEMPLATES = [
    "{% for i in range(10**8) %}{% endfor %}", "{{ 'x' * 10**10 }}", "{{ messages * 10**8 }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{% for m in messages %}{{ m['content'] }",
    "{{ raise_exception('no') }}", "{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}",
    "{% set ns = namespace(s='x') %}{% for i in range(80) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ messages[0]['content'] }}", "", "{{ 9 ** 9 ** 9 }}", "{{ bos_token }}{{ eos_token }}", "{% endfor %}",
    "{{ '%999999999d' % 1 }}", "{% include 'x' %}", "{{ lipsum(10**6) }}",
    "{{ lipsum(1000, false, 999999, 1000000) }}", "{{ range(10**9)|list|length }}",
]


def tok_files(world) -> list[Path]:
    return [world["ckpt"] / name for name in TOKENIZER_FILES if (world["ckpt"] / name).exists()]


def tok_flip(world, rng) -> str:
    return flip(rng.choice(tok_files(world)), rng)


def tok_truncate(world, rng) -> str:
    return truncate(rng.choice(tok_files(world)), rng)


def tok_fifo(world, rng) -> str:
    return fifo(rng.choice(tok_files(world)), rng)


def tok_link(world, rng) -> str:
    """A tokenizer file replaced by a symlink: out of the checkpoint (to a genuine copy), or to a copy inside."""
    path = rng.choice(tok_files(world))
    if rng.random() < 0.5:
        target = world["outside"] / path.name
        shutil.copy(path, target)
        where = "outside"
    else:
        target = world["ckpt"] / "shared" / path.name
        target.parent.mkdir(exist_ok=True)
        path.rename(target)
        where = "inside"
    path.unlink(missing_ok=True)
    path.symlink_to(os.path.relpath(target, path.parent))
    return f"link {path.name} -> {where}"


def tok_json(world, rng) -> str:
    """One hostile or random edit of tokenizer.json's JSON."""
    choice = rng.randrange(7)
    path = world["ckpt"] / "tokenizer.json"
    data = json.loads(path.read_text())
    if choice == 0:
        data["normalizer"] = rng.choice([
            {"type": "Replace", "pattern": {"Regex": rng.choice(REGEXES)},
             "content": rng.choice(["", "x", "y" * 10**5])},
            {"type": "Lowercase"}, {"type": "NFKC"}, {"type": "Nope"}, None, 5,
            {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581" * rng.choice([1, 10**6])}]}])
        what = f"normalizer {json.dumps(data['normalizer'])[:80]}"
    elif choice == 1:
        split = {"type": "Split", "pattern": {"Regex": rng.choice(REGEXES)}, "behavior": rng.choice(
            ["Isolated", "Removed", "Contiguous", "Bogus"]), "invert": rng.random() < 0.3}
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, data["pre_tokenizer"]]}
        what = f"pre_tokenizer {json.dumps(split)[:80]}"
    elif choice == 2:
        token = {"id": rng.choice([0, 5, 599, 600, 10**6, -1, 2**40]), "content": rng.choice(
            ["<|endoftext|>", "a", " plus", "", "x" * 10**4, "\x00"]), "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": rng.random() < 0.5, "special": rng.random() < 0.5}
        data["added_tokens"].append(token)
        what = f"added token {json.dumps(token)[:80]}"
    elif choice == 3:
        vocab = data["model"]["vocab"]
        key = rng.choice(sorted(vocab))
        new = rng.choice([-1, 10**7, "x", None, vocab[rng.choice(sorted(vocab))], 3.5])
        vocab[key] = new
        what = f"vocab {key!r} -> {new!r}"
    elif choice == 4:
        merges = data["model"]["merges"]
        i = rng.randrange(len(merges))
        merges[i] = rng.choice(["a", "x y", "", ["a"], 5, merges[-1]])
        what = f"merge {i} -> {merges[i]!r}"
    elif choice == 5:
        data["model"]["type"] = rng.choice(["WordPiece", "Unigram", "WordLevel", "Nope", None])
        what = f"model type {data['model']['type']}"
    else:
        key = rng.choice(sorted(data))
        data[key] = rng.choice([None, [], {}, "x", 1, True])
        what = f"{key} -> {data[key]!r}"
    path.write_text(json.dumps(data))
    return f"tokenizer.json {what}"


def tok_template(world, rng) -> str:
    """The chat template replaced by a hostile one, edited at random characters, or of another type."""
    path = world["ckpt"] / "tokenizer_config.json"
    choice = rng.randrange(4)
    if choice == 0:
        new = rng.choice(TEMPLATES)
    elif choice == 1:
        chars = list(TEMPLATE)
        for _ in range(rng.randint(1, 5)):
            i = rng.randrange(len(chars))
            op = rng.randrange(3)
            if op == 0:
                del chars[i]
            elif op == 1:
                chars.insert(i, rng.choice("{}%#'\"()[]|~.x \n"))
            else:
                chars[i] = rng.choice("{}%#'\"()[]|~.x")
        new = "".join(chars)
    elif choice == 2:
        new = TEMPLATE * rng.choice([2, 1000, 20000])
    else:
        new = rng.choice([None, 5, [], [{"name": "default", "template": TEMPLATE}], [{"name": "x"}],
                          {"default": TEMPLATE}, [{"name": "tool_use", "template": TEMPLATE}]])
    edit_json(path, lambda c: c.__setitem__("chat_template", new))
    return f"chat_template -> {json.dumps(new)[:80]}"


def tok_config(world, rng) -> str:
    """A token or class setting of tokenizer_config.json / special_tokens_map.json, or generation_config.json's
    eos_token_id."""
    choice = rng.randrange(3)
    if choice == 0:
        value = rng.choice([2, [0, 1], [], "two", -1, True, 10**30, [599, 600], None, [[0]], 1.5])
        edit_json(world["ckpt"] / "generation_config.json", lambda c: c.__setitem__("eos_token_id", value))
        return f"generation_config eos_token_id -> {value!r}"
    if choice == 1:
        key = rng.choice(["eos_token", "bos_token", "pad_token", "unk_token", "model_max_length",
                          "tokenizer_class", "add_bos_token", "clean_up_tokenization_spaces"])
        value = rng.choice([None, "", "<|new|>", " plus", 5, [], {"content": 1}, "x" * 1000, 10**30, True,
                            "GPT2Tokenizer", "LlamaTokenizer", "Nope"])
        edit_json(world["ckpt"] / "tokenizer_config.json", lambda c: c.__setitem__(key, value))
        return f"tokenizer_config {key} -> {value!r}"[:120]
    value = rng.choice([None, "<|new|>", 5, {"content": "<|endoftext|>", "special": "yes"}])
    if not (world["ckpt"] / "special_tokens_map.json").exists():  # transformers 5 saves none: one appears
        (world["ckpt"] / "special_tokens_map.json").write_text("{}")
    edit_json(world["ckpt"] / "special_tokens_map.json", lambda c: c.__setitem__("eos_token", value))
    return f"special_tokens_map eos_token -> {value!r}"


TOKENIZER_MUTATIONS = [tok_flip, tok_flip, tok_truncate, tok_fifo, tok_link, tok_json, tok_json, tok_json,
                       tok_template, tok_template, tok_config]


def build_tokenizer_world(case: Path, genuine: Path) -> dict:
    ckpt, outside = case / "ckpt", case / "outside"
    shutil.copytree(genuine, ckpt)
    outside.mkdir()
    return {"ckpt": ckpt, "outside": outside}


def tokenizer_fingerprint(world) -> list:
    """What nano_eval builds from the checkpoint's tokenizer before a forward: the folder checks and the probe
    (load_transformers), EOS ids, the token ids of the first 4 documents' requests, plain and chat-rendered."""
    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks.registry import load_tasks

    backend = load_transformers(str(world["ckpt"]))
    tasks = load_tasks(TASK)
    out = []
    for chat in (False, True):
        ev = Evaluator(backend, tasks, EvalConfig(max_samples=4, use_chat_template=chat, progress=False))
        out.append(sorted(ev.engine.tokens.eos_ids))
        out += [repr(r) for p in ev.prepared for r in p.requests]
        out += [repr(row) for d in ev.datasets.values() for row in d.items]
    return out


def tokenizer_case(world, reference) -> tuple[str, str]:
    from nano_eval.errors import NanoEvalError

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            got = tokenizer_fingerprint(world)
        return ("same" if got == reference else "different"), ""
    except NanoEvalError as e:
        return _refused(e)
    except BaseException as e:  # noqa: BLE001 - the defect the fuzz looks for (a Rust panic is a BaseException)
        return _crash(e)


# ---- outputs surface ----------------------------------------------------------------------------------------------

SETTINGS = {"tasks": [TASK], "max_samples": 2, "seed": 0}
IDENTITY = "ident-" + "0" * 26
RUNNING = {"123": {"launcher": "local", "attempt": 1, "submission": "ab" * 16,
                   "checkpoints": {"checkpoint-8": IDENTITY}}}


def _results(acc: float):
    details = [{"doc": i, "acc": acc} for i in range(3)]
    task = SimpleNamespace(version=0, metrics={"acc": acc}, num_docs=3, skipped_docs=0, truncated_requests=0,
                           details=details)
    return SimpleNamespace(tasks={TASK: task}, timings={"total_s": 1.0}, failed=None)


def _document(results):
    from nano_eval.parallel import ParallelLayout
    from nano_eval.tracking.results import results_document

    return results_document(results, layout=ParallelLayout(), config=SETTINGS, step=8, consumed_tokens=0,
                            extra={"sweep": {"evaluation_identity": IDENTITY, "checkpoint_name": "checkpoint-8"}})


def build_outputs_world(case: Path) -> dict:
    from nano_eval.tracking.files import write_json
    from nano_eval.tracking.results import write_results

    out, victim = case / "out", case / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.jsonl").write_text('{"mine": 1}\n')
    (victim / "results.json").write_text('{"mine": 2}')
    (victim / "sub").mkdir()
    (victim / "sub" / "keep.txt").write_text("mine")
    out.mkdir()
    write_json(out / "sweep_settings.json", SETTINGS, root=out)
    (out / "jobs").mkdir()
    write_json(out / "jobs" / "running.json", RUNNING, root=out)
    old = _results(0.25)
    write_results(out / "checkpoint-8", _document(old), old, details=True, root=out)
    return {"out": out, "victim": victim}


def out_entries(world) -> list[Path]:
    out = world["out"]
    return [out / "sweep_settings.json", out / "jobs" / "running.json", out / "checkpoint-8" / "results.json",
            *sorted((out / "checkpoint-8" / "details").glob("*.jsonl"))]


def out_flip(world, rng) -> str:
    return flip(rng.choice(out_entries(world)), rng)


def out_truncate(world, rng) -> str:
    return truncate(rng.choice(out_entries(world)), rng)


def out_fifo(world, rng) -> str:
    return fifo(rng.choice(out_entries(world)), rng)


def out_type(world, rng) -> str:
    """A JSON value of one of the files replaced by one of another type."""
    path = rng.choice(out_entries(world)[:3])
    data = json.loads(path.read_text())
    new = rng.choice([None, [], "x", 1, True, 1e308, {"a": {}}, [[]], -(2 ** 70)])
    if rng.random() < 0.3 or not data:
        data = new
        what = "whole"
    else:
        key = rng.choice(sorted(data))
        if isinstance(data[key], dict) and data[key] and rng.random() < 0.5:
            sub = rng.choice(sorted(data[key]))
            data[key][sub] = new
            key = f"{key}.{sub}"
        else:
            data[key] = new
        what = key
    path.write_text(json.dumps(data))
    return f"json {path.name} {what} -> {new!r}"


def out_link(world, rng) -> str:
    """A file or a folder replaced by a symlink into the victim folder."""
    out, victim = world["out"], world["victim"]
    choices = out_entries(world) + [out / "checkpoint-8", out / "checkpoint-8" / "details", out / "jobs"]
    path = rng.choice(choices)
    if path.is_dir():
        shutil.rmtree(path)
        target = rng.choice([victim, victim / "sub"])
    else:
        path.unlink()
        target = rng.choice([victim / "precious.jsonl", victim / "results.json", victim / "sub"])
    path.symlink_to(target)
    return f"link {path.relative_to(out)} -> victim/{target.relative_to(victim)}"


def out_sparse(world, rng) -> str:
    path = rng.choice(out_entries(world))
    with path.open("r+b") as fh:
        fh.truncate(8 << 30)
    return f"sparse 8 GiB {path.name}"


def out_folder(world, rng) -> str:
    path = rng.choice(out_entries(world))
    path.unlink()
    path.mkdir()
    (path / "x").write_text("x")
    return f"folder in place of {path.name}"


OUTPUT_MUTATIONS = [out_flip, out_flip, out_truncate, out_fifo, out_type, out_type, out_link, out_link, out_sparse,
                    out_folder]


def _entry(path: Path):
    """What is at `path` (not followed), to compare before and after a refusal."""
    if path.is_symlink():
        return ("link", os.readlink(path))
    if not path.exists():
        return None
    if path.is_dir():
        return ("dir",)
    if not path.is_file():
        return ("special",)
    size = path.stat().st_size
    return ("file", size, path.read_bytes() if size < 1 << 20 else None)


def outputs_steps(world) -> list[tuple[str, str]]:
    """What a restarted sweep does with the folder, step by step: (outcome, message) of each."""
    from nano_eval.errors import NanoEvalError
    from nano_eval.sweep.launch import LaunchedSweep, _running_record_problem
    from nano_eval.sweep.lock import check_settings
    from nano_eval.sweep.runner import finished_identity
    from nano_eval.tracking.results import read_results, write_results

    out = world["out"]
    ckpt = out / "checkpoint-8"
    new = _results(0.75)
    document = _document(new)

    def settings():
        check_settings(out, SETTINGS)
        return "handled", ""

    def running():
        records = LaunchedSweep._read_running(SimpleNamespace(out=out))  # a flip inside a value reads as another
        ok = isinstance(records, dict) and all(_running_record_problem(k, v) is None for k, v in records.items())
        return ("handled", "") if ok else ("wrong", f"running.json read as {records!r:.200}")

    def earlier():
        identity = finished_identity(ckpt / "results.json", root=out)
        # another identity (a flip inside it) only means the checkpoint is scored again
        return ("handled", "") if isinstance(identity, (str, type(None))) else ("wrong", f"identity {identity!r:.200}")

    def write():
        write_results(ckpt, document, new, details=True, root=out)
        back = read_results(ckpt / "results.json", root=out)
        details = (ckpt / "details").glob("*.jsonl")
        rows = [json.loads(line) for f in details for line in f.read_text().splitlines()]
        ok = back == json.loads(json.dumps(document)) and rows == new.tasks[TASK].details
        return ("handled", "") if ok else ("wrong", "the written results do not read back")

    steps = []
    for name, step, kept in (("settings", settings, out / "sweep_settings.json"),
                             ("running", running, out / "jobs" / "running.json"),
                             ("earlier", earlier, None), ("write", write, ckpt / "results.json")):
        before = _entry(kept) if kept is not None else None
        try:
            outcome, message = step()
        except NanoEvalError as e:
            outcome, message = _refused(e)
            if outcome == "refused" and kept is not None and _entry(kept) != before:
                outcome, message = "wrong", f"{kept.name} changed on a refusal: {message}"
        except BaseException as e:  # noqa: BLE001 - the defect the fuzz looks for
            outcome, message = _crash(e)
        steps.append((outcome, f"{name}: {message}" if message else ""))
    return steps


RANK = ["crash", "memory", "timeout", "outside", "wrong", "refused", "handled"]


def outputs_case(world) -> tuple[str, str]:
    before = snapshot(world["victim"])
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        steps = outputs_steps(world)
    if snapshot(world["victim"]) != before:
        return "outside", "the victim folder changed"
    outcome = min((o for o, _ in steps), key=RANK.index)
    return outcome, " | ".join(m for o, m in steps if o == outcome and m)


# ---- running cases ------------------------------------------------------------------------------------------------

def run(surface: str, work: Path, seed: int, cases: int) -> dict:
    import warnings

    import torch

    from nano_eval.toy import build_toy_checkpoint

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if surface == "tokenizer":
        genuine = build_toy_checkpoint(work / "genuine")
        edit_json(genuine / "tokenizer_config.json", lambda c: c.__setitem__("chat_template", TEMPLATE))
        reference = tokenizer_fingerprint(build_tokenizer_world(work / "control", genuine))
    else:
        outputs_case(build_outputs_world(work / "control"))  # imports everything, before the limit
    if surface == "tokenizer":
        got, seconds = run_cases(work, seed, cases, lambda case: build_tokenizer_world(case, genuine),
                                 TOKENIZER_MUTATIONS, lambda world: tokenizer_case(world, reference), CASE_ALARM_S,
                                 CAP_BYTES)
    else:
        got, seconds = run_cases(work, seed, cases, build_outputs_world, OUTPUT_MUTATIONS, outputs_case,
                                 CASE_ALARM_S, CAP_BYTES)
    return {"surface": surface, "seed": seed, "cases": got, "seconds": seconds}


def main(argv=None) -> int:
    return fuzz_main(run, ["tokenizer", "outputs"], argv)


if __name__ == "__main__":
    raise SystemExit(main())
