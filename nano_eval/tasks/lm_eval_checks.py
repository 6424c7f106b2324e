"""What nano_eval refuses in an lm-eval task, before and after it is scored (nano_eval.tasks.lm_eval_tasks).

Before any model (when the task loads): what nano_eval cannot score exactly as lm-eval would (`unsupported_reasons`:
sampled generation, repeats, multimodal tasks, generated code, remote services), and `generation_kwargs` that
lm-eval's own `hf` model would fail on or that no evaluation needs (`generation_settings`: `until: 5`,
`max_gen_toks: abc`, a million stop strings), each refused by name.

While it runs: task code cannot end the process (`task_code`: a SystemExit from `sys.exit` in a task's Python, or
another BaseException but Ctrl-C's KeyboardInterrupt, fails that task with a TaskCodeError, one line), and no number
comes from garbage (`check_values`, `check_metrics`: a NaN or infinite value from lm-eval's `process_results`,
metric or aggregation fails the task with a NonFiniteScoreError naming the task and the document, as NaN / inf
log-probs do: nano_eval.finite).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Iterator

from nano_eval.errors import NanoEvalError, NonFiniteScoreError, TaskCodeError, UnsupportedTaskError
from nano_eval.local_files import printable
from nano_eval.tasks.lm_eval_remote import remote_calls

OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "loglikelihood_rolling", "generate_until")
MAX_GEN_TOKS = 256  # lm-eval's hf model's max_gen_toks
MAX_STOP_SEQUENCES = 256  # `until` strings of one task (lm-eval's catalogue: at most 12)
MAX_STOP_CHARS = 4096  # characters of one stop string (lm-eval's catalogue: under 100)
MAX_GENERATED = 1_000_000  # max_gen_toks (a model's context is the real bound; past this it is a typo)
TOKEN_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's, by priority
FIX_CONFIG = ("Fix: correct generation_kwargs in the task's YAML (lm-eval's form: until: a string or a list of "
              "strings, max_gen_toks: a positive integer, do_sample: true / false, temperature: a number)")


def unsupported_reasons(task) -> list[str]:
    """Why nano_eval cannot score this lm-eval task object exactly as lm-eval would (empty: it can). Malformed
    generation_kwargs raise UnsupportedTaskError (generation_settings)."""
    cfg, reasons = task.config, []
    if task.OUTPUT_TYPE not in OUTPUT_TYPES:
        reasons.append(f"output_type {task.OUTPUT_TYPE!r} (nano_eval scores {', '.join(OUTPUT_TYPES)})")
    if getattr(task, "MULTIMODAL", False):
        reasons.append("it is multimodal (images or audio); nano_eval scores text-only models")
    if getattr(task, "UNSAFE_CODE", False):
        reasons.append("it runs the model's generated code")
    remote = remote_calls(task)
    if remote is not None:
        reasons.append(f"it calls a remote API or service ({remote}): an API or LLM judge needs network access and "
                       "credentials, sends the model's outputs elsewhere and scores with a model nobody pins; "
                       "nano_eval scores offline")
    repeats = cfg.repeats if isinstance(cfg.repeats, int) and not isinstance(cfg.repeats, bool) else 1
    if repeats > 1:
        reasons.append(f"repeats={cfg.repeats} (several samples per document); nano_eval decodes greedily once")
    if task.OUTPUT_TYPE == "generate_until":
        gen = generation_settings(cfg.generation_kwargs, f"task {task.config.task!r}")
        if gen["do_sample"] or (gen["do_sample"] is None and gen["temperature"] > 0):
            reasons.append(f"sampled generation (do_sample={gen['do_sample']}, temperature={gen['temperature']}); "
                           "nano_eval decodes greedily")
        if gen["num_beams"] > 1:
            reasons.append(f"beam search (num_beams={gen['num_beams']}); nano_eval decodes greedily")
    return reasons


def generation_settings(gen: Any, where: str) -> dict[str, Any]:
    """lm-eval's generation_kwargs checked and read as its hf model reads them: {"until": [stop strings],
    "max_gen_toks": int, "do_sample": bool or None, "temperature": float, "num_beams": int}. Anything its hf model
    would fail on (a stop that is no string, a token count that is no integer) or that no evaluation needs (more
    than MAX_STOP_SEQUENCES stops, a stop over MAX_STOP_CHARS characters, more than MAX_GENERATED tokens) raises
    UnsupportedTaskError naming `where` and the setting."""
    def refuse(what: str) -> UnsupportedTaskError:
        return UnsupportedTaskError(f"{where}: generation_kwargs {what}. {FIX_CONFIG}", task=where)

    if gen is None:
        gen = {}
    if not isinstance(gen, dict):
        raise refuse(f"is a {type(gen).__name__}, not a mapping")
    until = gen.get("until", [])
    stops = until if isinstance(until, list) else [until] if until is not None else []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise refuse(f"until holds {len(stops):,} stop sequences, more than {MAX_STOP_SEQUENCES} (no evaluation "
                     "needs that many; checking them at every generated token would take hours)")
    for stop in stops:
        if not isinstance(stop, str):
            raise refuse(f"until holds {printable(repr(stop))[:80]} ({type(stop).__name__}), not a string")
        if len(stop) > MAX_STOP_CHARS:
            raise refuse(f"until holds a stop sequence of {len(stop):,} characters, more than {MAX_STOP_CHARS:,}")
    given = [(name, gen[name]) for name in TOKEN_ALIASES if gen.get(name) is not None]
    max_gen_toks = _integer(*given[0], refuse) if given else MAX_GEN_TOKS
    if not 0 < max_gen_toks <= MAX_GENERATED:
        raise refuse(f"{given[0][0]} is {max_gen_toks}, not between 1 and {MAX_GENERATED:,}")
    do_sample = gen.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise refuse(f"do_sample is {printable(repr(do_sample))[:80]}, not true or false")
    temperature = gen.get("temperature", 0.0)
    try:
        temperature = float(0.0 if temperature is None else temperature)
    except (TypeError, ValueError):
        raise refuse(f"temperature is {printable(repr(temperature))[:80]}, not a number") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise refuse(f"temperature is {temperature}, not a finite number >= 0")
    num_beams = _integer("num_beams", gen.get("num_beams") or 1, refuse)
    return {"until": [s for s in stops if s], "max_gen_toks": max_gen_toks, "do_sample": do_sample,
            "temperature": temperature, "num_beams": num_beams}


def _integer(name: str, value: Any, refuse) -> int:
    """`value` as an integer, as lm-eval's `int(...)` reads it (an int, an integral float, a string of digits)."""
    if isinstance(value, bool):
        raise refuse(f"{name} is {value}, not an integer")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value.strip()) <= 9:
        return int(value)
    raise refuse(f"{name} is {printable(repr(value))[:80]}, not an integer")


@contextlib.contextmanager
def task_code(task: str, what: str) -> Iterator[None]:
    """Run task code (`what`: "loading", "building the requests of 'x'", "scoring 'x'"): a SystemExit, or another
    BaseException but KeyboardInterrupt (Ctrl-C stops nano_eval as always), becomes a TaskCodeError naming `task`."""
    try:
        yield
    except (Exception, KeyboardInterrupt):  # noqa: B014 -- ordinary errors are handled by the caller
        raise
    except BaseException as e:  # noqa: BLE001 -- sys.exit() and its like, from task code
        detail = printable(" ".join(str(e).split())[:200])
        raise TaskCodeError(
            f"task {task}: its code raised {type(e).__name__}{f'({detail})' if detail else ''} while {what}, which "
            "would have ended the process; the task fails, the other tasks go on. Fix: the task's Python (its "
            "--lm-eval-include-path file or lm-eval's) must return or raise an Exception, never call sys.exit().",
            task=task) from None


def _number(value: Any) -> float | None:
    """`value` as a float when it is a real number (bool excluded), else None."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def check_values(task: str, leaf: str, doc_id: int, values: dict) -> None:
    """One document's `process_results` values: each number must be finite (NonFiniteScoreError naming the task,
    the lm-eval task and the document); values that are no number (a corpus metric's (gold, prediction) pairs)
    are left to `check_metrics`."""
    if not isinstance(values, dict):
        raise NanoEvalError(f"task {task}: lm-eval task {leaf!r}, document {doc_id}: process_results returned a "
                            f"{type(values).__name__}, not a dict of metric values. Fix: the task's process_results.")
    for metric, value in values.items():
        number = _number(value)
        if number is not None and not math.isfinite(number):
            raise NonFiniteScoreError(
                f"task {task}, document {doc_id}: the process_results of lm-eval task {leaf!r} gave "
                f"{printable(str(metric))} = {number}, and a score from NaN / inf is no score. Fix: the task's "
                "process_results or metric (its Python in --lm-eval-include-path, or lm-eval's) must return finite "
                "numbers.", task=task)


def check_metrics(task: str, name: str, metrics: dict) -> None:
    """An aggregated result (lm-eval's `metric,filter` keys): every number must be finite, but a stderr may be NaN
    (none, as lm-eval's "N/A")."""
    for key, value in metrics.items():
        if "," not in str(key):
            continue  # alias, name, sample_len, sample_count
        number = _number(value)  # what is no number is not reported, as before (lm-eval's "N/A" stderr: NaN)
        if number is not None and (math.isinf(number) or math.isnan(number) and "_stderr," not in str(key)):
            raise NonFiniteScoreError(f"task {task}: lm-eval's aggregation of {name!r} gave {printable(str(key))} = "
                                      f"{number}, and a score from NaN / inf is no score. Fix: the task's metric or "
                                      "aggregation must give finite numbers.", task=task)
