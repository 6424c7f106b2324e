"""Hostile tokenizers, chat templates and generation configs: a checkpoint folder brings tokenizer.json,
tokenizer_config.json (with its chat template) and generation_config.json, and each is untrusted code or data.

Each case below is the toy checkpoint with one of those files edited as a hostile-user review found them: a chat
template that loops 10^10 times, builds a 5 GB string, recurses or does not parse; a pre-tokenizer regex that
backtracks (seconds per text) or panics past Onig's retry limit (a BaseException); a normalizer that leaves no
tokens or inserts 2 MB per character (gigabytes, then a Rust abort); a tokenizer.json whose JSON takes 26x its size
once parsed; 100k added tokens (each handled in Python: 24 s to load); eos_token_id "two". Every case runs through the command line (`nano_eval.cli.main`, as
`python nano_eval/run.py` runs it) in one child process, under an address-space limit of 4 GiB over what its
imports take, and must end with exit code 2 and one `nano_eval: error:` line, without a traceback, within 60 s.
The last test is a sweep: a checkpoint whose tokenizer panics is one failed checkpoint, and the next is scored.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fuzz_case import address_space
from tests.test_faults import _error_lines, _sweep

REPO = Path(__file__).resolve().parents[1]
CAP_BYTES = 4 << 30
CASE_S = 60
TASK = "demo|arithmetic|0"

SLOW_REGEX = r"(\w|\w|\w|\w|\w)*\d|(\w|\w|\w|\w|\w)*@|(\w|\w|\w|\w|\w)*#"  # 0.4-1.3 ms a character (genuine: ~1 us)
PANIC_REGEX = r"(\w|\w|\w|\w|\w|\w)*\d"  # past Onig's retry limit on "Question": pyo3_runtime.PanicException


def _template(source: str):
    return "tokenizer_config.json", lambda config: config.__setitem__("chat_template", source)


def _pre_tokenizer(regex: str):
    def edit(tokenizer: dict) -> None:
        split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}

    return "tokenizer.json", edit


def _normalizer(normalizer: dict):
    return "tokenizer.json", lambda tokenizer: tokenizer.__setitem__("normalizer", normalizer)


def _amplifying_json(folder: Path) -> None:
    """tokenizer.json of 180 MB (under the 512 MiB size limit) holding 60 million empty objects: ~4.3 GB as
    Python objects."""
    text = (folder / "tokenizer.json").read_text()
    with (folder / "tokenizer.json").open("w") as fh:
        fh.write(text[:-1] + ', "padding_objects": [' + "{}," * 60_000_000 + "{}]}")


def _gigabyte_template(folder: Path) -> None:
    """chat_template.jinja of 1 GiB (sparse: no disk used), which transformers reads whole when it loads the
    tokenizer."""
    with (folder / "chat_template.jinja").open("wb") as fh:
        fh.truncate(1 << 30)


# name: (file, edit of its JSON | function of the folder, what the error line says, extra arguments)
CASES = {
    "template: nested range(100000) loops": (
        *_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"),
        "takes more steps than any genuine template needs", ["--use-chat-template"]),
    "template: 'x' * 5000000000": (*_template("{{ 'x' * 5000000000 }}"), "builds a str of 5,000,000,000",
                                   ["--use-chat-template"]),
    "template: doubling a string": (
        *_template("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                   "{{ ns.s }}"), "builds a str of", ["--use-chat-template"]),
    "template: recursion": (*_template("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"),
                            "recurses past Python's limit", ["--use-chat-template"]),
    "template: syntax error": (*_template("{% for m in messages %}{{ m['content'] }"),
                               "does not compile (TemplateSyntaxError", ["--use-chat-template"]),
    "template: raise_exception": (*_template("{{ raise_exception('only user and assistant roles') }}"),
                                  "fails (TemplateError: only user and assistant roles)", ["--use-chat-template"]),
    "tokenizer: backtracking pre-tokenizer regex": (*_pre_tokenizer(SLOW_REGEX), "to encode a text of", []),
    "tokenizer: pre-tokenizer regex past Onig's limit": (*_pre_tokenizer(PANIC_REGEX),
                                                         "panics when encoding", []),
    "tokenizer: normalizer regex past Onig's limit": (
        *_normalizer({"type": "Replace", "pattern": {"Regex": PANIC_REGEX}, "content": "x"}), "panics", []),
    "tokenizer: normalizer leaves no tokens": (
        *_normalizer({"type": "Replace", "pattern": {"Regex": "[\\s\\S]"}, "content": ""}), "into no tokens", []),
    "tokenizer: normalizer inserts 2 MB per character": (
        *_normalizer({"type": "Replace", "pattern": {"String": "e"}, "content": "x" * (2 << 20)}),
        "has a Replace step that inserts 2,097,152 characters", []),
    "tokenizer: JSON that takes 26x its size parsed": (None, _amplifying_json, "JSON values", []),
    "tokenizer: 100k added tokens": ("tokenizer.json", lambda tokenizer: tokenizer["added_tokens"].extend(
        {"id": 1000 + i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i in range(100_000)), "adds 100,001 tokens", []),
    "template: a 1 GiB chat_template.jinja": (None, _gigabyte_template, "chat_template.jinja: is 1.0 GiB", []),
    "generation_config: eos_token_id 'two'": (
        "generation_config.json", lambda config: config.__setitem__("eos_token_id", "two"),
        "has eos_token_id='two'", []),
}


def build_case(toy_checkpoint: Path, root: Path, name: str, folder: Path | None = None) -> Path:
    """A copy of the toy checkpoint (in `folder`, else a folder of `root` named after the case) edited as case
    `name` says."""
    file, edit, _, _ = CASES[name]
    folder = folder or root / "".join(c if c.isalnum() else "_" for c in name)
    shutil.copytree(toy_checkpoint, folder)
    if file is None:
        edit(folder)
    else:
        data = json.loads((folder / file).read_text())
        edit(data)
        (folder / file).write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def outcomes(toy_checkpoint, tmp_path_factory) -> dict:
    """{case name: {"code", "stderr", "seconds"}}: every case through the command line, in one child process
    under the address-space limit (this file's __main__)."""
    root = tmp_path_factory.mktemp("hostile_tokenizers")
    plan = [{"name": name, "args": ["--checkpoint", str(build_case(toy_checkpoint, root, name)), "--tasks", TASK,
                                    "--max-samples", "4", "--output-dir", str(root / f"out{i}"), *CASES[name][3]]}
            for i, name in enumerate(CASES)]
    plan.insert(0, {"name": "genuine", "args": ["--checkpoint", str(toy_checkpoint), "--tasks", TASK,
                                                "--max-samples", "4", "--use-chat-template", "--output-dir",
                                                str(root / "genuine")]})
    (root / "plan.json").write_text(json.dumps(plan))
    report = root / "report.jsonl"
    done = subprocess.run([sys.executable, "-m", "tests.test_hostile_tokenizers", str(root / "plan.json"),
                           str(report)], capture_output=True, text=True, timeout=CASE_S * (len(plan) + 1),
                          cwd=REPO, env={**os.environ, "RUST_BACKTRACE": "0",
                                         "TOKENIZERS_PARALLELISM": "false"})
    got = {row["name"]: row for row in map(json.loads, report.read_text().splitlines())} if report.exists() else {}
    assert done.returncode == 0 and len(got) == len(plan), (
        f"the child ended with {done.returncode} after {list(got)}:\n{done.stderr[-3000:]}")
    return got


def test_a_genuine_template_and_tokenizer_are_not_refused(outcomes):
    """The control: the toy checkpoint with a template (set in the child) passes every check and probe."""
    row = outcomes["genuine"]
    assert row["code"] == 0, row["stderr"][-2000:]


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line_in_time_and_memory(outcomes, name):
    row = outcomes[name]
    expected = CASES[name][2]
    lines = _error_lines(row["stderr"])
    assert row["code"] == 2 and "Traceback" not in row["stderr"], row["stderr"][-3000:]
    assert len(lines) == 1 and expected in lines[0] and "Fix:" in lines[0], row["stderr"][-3000:]
    assert "MemoryError" not in row["stderr"] and row["seconds"] < CASE_S, row


# Templates that allocate, loop or compute without bound in other ways than the cases above, each refused in
# milliseconds by the renderer's budget (nano_eval.chat_template), in this process.
TEMPLATE_BOMBS = {
    "{{ 'x'|center(10**9) }}": "passes the number 1,000,000,000",
    "{{ 'x'.center(100000000) }}": "passes the number 100,000,000",
    "{{ range(100000)|join('x'*1000) }}": "builds a str of 100,487,890",
    "{{ '%099999999d' % 1 }}": "formats with a width",
    "{{ '{:>999999999}'.format('x') }}": "formats with a width",
    "{{ ('x'*1000000).replace('', 'yy') }}": "builds a str of 3,000,002",
    "{{ ('a\n' * 400000)|indent(100) }}": "builds a str of 40,800,100",
    "{{ ('x'*100000)|wordwrap(1, wrapstring='y'*100000) }}": "builds a str of",
    "{{ {'a': 1}|tojson(indent=10**8) }}": "passes the number 100,000,000",
    "{{ messages * 10**7 }}": "builds a list of 10,000,000",
    "{{ 9 ** 99999 }}": "raises 9 to the power 99,999",
    "{% set ns = namespace(n=2) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}":
        "multiplies integers",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set s %}{{ ns.s }}{{ ns.s }}{% endset %}"
    "{% set ns.s = s %}{% endfor %}": "builds a str of 2,097,152",
    "{% macro f(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = f(ns.s) %}{% endfor %}": "builds a str of 2,097,152",
    "{{ (['x']*1000)|map('center', 1000000)|list|length }}": "in all",
    "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}": "more steps",
    "{{ ('x' * 1000).expandtabs(100) }}": "calls str.expandtabs",
    "{{ lipsum(1000, false, 9999, 10000) }}": "asks lipsum() for up to 10,000,000 words",  # found by the fuzz
    "{{ lipsum(2, false, 1, 1e7) }}": "not integers",
    "{{ x }}" * 150_000: "is 1,050,000 characters long",  # compiling it: 24 s and 1.3 GB
}


@pytest.mark.parametrize("source", list(TEMPLATE_BOMBS), ids=lambda source: source[:60])
def test_template_bombs_are_refused_at_once(source):
    from nano_eval.chat_template import ChatTemplate, ChatTemplateError

    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=re.escape(TEMPLATE_BOMBS[source])):
        ChatTemplate(source, "'t'").render([{"role": "user", "content": "Question: 3 plus 4"}])
    assert time.perf_counter() - start < 5


# Genuine templates (SmolLM2's ChatML, Llama 3's, Mistral's, a Qwen-like one with namespaces, reversed loops,
# block sets, tojson, str.format, %-formatting and filters): rendered exactly as transformers renders them.
GENUINE_TEMPLATES = [
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou"
    " are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] +"
    " ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% elif "
    "message['role'] == 'system' %}{{ '<<SYS>>' ~ message['content'] ~ '<</SYS>>' }}{% endif %}{% endfor %}",
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}{%- for message in "
    "messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}{%- if ns.multi_step_tool and "
    "message.role == 'user' %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + "
    "'<|im_end|>' + '\n' }}{%- if loop.last %}{{ {'n': loop.length, 'idx': ns.last_query_index} | tojson(indent=2) }}"
    "{% endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}{% set x %}"
    "{{ messages|length }} msgs{% endset %}{{ x|upper }}{{ '%s-%d' % ('a', 3) }}{{ '{} {}'.format('a','b') }}"
    "{{ messages|map(attribute='role')|join(', ') }}{{ 'ab'|center(6) }}{{ 'a\nb'|indent(2) }}",
]


@pytest.mark.parametrize("index", range(len(GENUINE_TEMPLATES)))
def test_genuine_templates_render_as_transformers_renders_them(toy_checkpoint, index):
    from transformers import AutoTokenizer

    from nano_eval.tokenization import chat_renderer

    tokenizer = AutoTokenizer.from_pretrained(str(toy_checkpoint))
    tokenizer.bos_token, tokenizer.chat_template = "<|endoftext|>", GENUINE_TEMPLATES[index]
    messages = [{"role": "system", "content": "Add the numbers."}]
    for i in range(25):  # a 25-shot prompt
        messages += [{"role": "user", "content": f"Question: {i} plus {i}\nAnswer:"},
                     {"role": "assistant", "content": str(2 * i)}]
    messages.append({"role": "user", "content": "Question: 7 plus 8\nAnswer:"})
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_renderer(tokenizer)(messages) == expected


def test_a_tokenizer_slow_on_every_text_is_refused_after_seconds_not_hours(toy_checkpoint, tmp_path, monkeypatch):
    """One that passes each encoding's own limit (a short text at ~1 ms a character) is refused once all its
    encodings took SLOW_TOTAL_S (here 0.3 s) more than a genuine tokenizer could; the genuine toy tokenizer encodes
    a task's worth of texts under the real limits."""
    from transformers import AutoTokenizer

    import nano_eval.tokenization as tokenization
    from nano_eval.tokenization import Tokenization, TokenizerError

    text = "Question: 3 plus 4\nAnswer:"
    genuine = Tokenization.of(AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    for _ in range(3000):
        genuine.text(text)
    slow = AutoTokenizer.from_pretrained(str(build_case(toy_checkpoint, tmp_path, "tokenizer: backtracking "
                                                                                   "pre-tokenizer regex")))
    monkeypatch.setattr(tokenization, "SLOW_TOTAL_S", 0.3)
    tokens = Tokenization.of(slow)
    with pytest.raises(TokenizerError, match=r"took .* to encode \d+ texts of \d+ characters in all"):
        for _ in range(1000):
            tokens.text(text)
    assert tokens.budget.calls < 1000


def test_a_sweep_goes_on_past_a_checkpoint_whose_tokenizer_panics(toy_checkpoint, tmp_path, capsys):
    """pyo3's PanicException is a BaseException: it used to escape the sweep's `except Exception` and end the
    sweep, the later checkpoints unscored and no table written."""
    from nano_eval.cli import main
    from nano_eval.sweep.table import read_table

    run = tmp_path / "run"
    build_case(toy_checkpoint, run, "tokenizer: pre-tokenizer regex past Onig's limit", run / "checkpoint-1")
    shutil.copytree(toy_checkpoint, run / "checkpoint-2")
    assert main(_sweep(run, tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert "checkpoint-1" in _error_lines(err)[-1] and "failed and were skipped" in _error_lines(err)[-1], err
    rows = read_table(tmp_path / "out")
    assert sorted({r["step"] for r in rows if not r["error"]}) == [2]
    [failed] = [r for r in rows if r["error"]]
    assert failed["step"] == 1 and "panics when encoding" in failed["error"]


def test_a_sweep_goes_on_past_a_rust_panic_from_anywhere(toy_checkpoint, tmp_path, capsys, monkeypatch):
    """Tokenizer calls turn their panics into refusals; the sweep also records a panic from any other Rust library
    (the real pyo3 PanicException, raised here while scoring checkpoint-1) as that checkpoint's failure."""
    from tokenizers import Regex, pre_tokenizers

    import nano_eval.sweep.runner as runner
    from nano_eval.cli import main
    from nano_eval.sweep.table import read_table

    try:
        pre_tokenizers.Split(Regex(PANIC_REGEX), "isolated").pre_tokenize_str("Question")
    except BaseException as e:  # noqa: BLE001 -- the panic this test needs
        panic = e
    assert type(panic).__name__ == "PanicException" and not isinstance(panic, Exception)
    genuine = runner.evaluate_item

    def evaluate_item(job, tasks, run_dir, item):
        if item.ckpt.step == 1:
            raise panic
        return genuine(job, tasks, run_dir, item)

    monkeypatch.setattr(runner, "evaluate_item", evaluate_item)
    run = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(toy_checkpoint, run / f"checkpoint-{step}")
    assert main(_sweep(run, tmp_path / "out")) == 1
    assert "failed and were skipped" in _error_lines(capsys.readouterr().err)[-1]
    rows = read_table(tmp_path / "out")
    assert sorted({r["step"] for r in rows if not r["error"]}) == [2]
    assert [r["error"] for r in rows if r["step"] == 1] == ["PanicException: Onig: Regex search error: "
                                                             "retry-limit-in-match over"]


# ---- the child process ------------------------------------------------------------------------------------------

def _run_cases(plan_path: Path, report_path: Path) -> None:
    """Each planned command line through nano_eval.cli.main, stderr captured, under RLIMIT_AS = the size after
    imports + CAP_BYTES; one JSON line per case, written as it ends (a case that kills the process is the one
    after the last line)."""
    import warnings

    import torch

    from nano_eval.cli import main

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    plan = json.loads(plan_path.read_text())
    genuine = Path(plan[0]["args"][1])
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = json.loads((genuine / "tokenizer_config.json").read_text())
    control = plan_path.parent / "genuine_ckpt"
    shutil.copytree(genuine, control)
    (control / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    plan[0]["args"][1] = str(control)
    main(["--checkpoint", str(control), "--tasks", TASK, "--max-samples", "1", "--output-dir",
          str(plan_path.parent / "warm")])  # imports everything a case needs, before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + CAP_BYTES, hard))

    def timeout(signum, frame):
        raise TimeoutError(f"the case did not end within {CASE_S}s")

    signal.signal(signal.SIGALRM, timeout)
    with report_path.open("w") as report:
        for case in plan:
            err = io.StringIO()
            start = time.perf_counter()
            signal.alarm(CASE_S)
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    code = main(case["args"])
            except BaseException as e:  # noqa: BLE001 -- recorded: the test says which case and how
                code, _ = -1, err.write(f"Traceback: {type(e).__name__}: {e}")
            finally:
                signal.alarm(0)
            row = {"name": case["name"], "code": code, "stderr": err.getvalue()[-5000:],
                   "seconds": round(time.perf_counter() - start, 2)}
            report.write(json.dumps(row) + "\n")
            report.flush()


if __name__ == "__main__":
    _run_cases(Path(sys.argv[1]), Path(sys.argv[2]))
