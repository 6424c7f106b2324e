"""The command line: help, input errors, broken pipes, the three entry points, W&B from the script entry point,
and files that teams can share (umask) and that never leave the output folder."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nano_eval.cli import main
from nano_eval.cli.eval import build_parser as eval_parser
from nano_eval.cli.sweep import build_parser as sweep_parser
from nano_eval.tracking.files import safe_file_name
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
RUN_PY = str(REPO / "nano_eval" / "run.py")
TASKS = "demo|arithmetic|0,demo|arithmetic_gen|0,demo|arithmetic_ppl|0"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ---- help ----------------------------------------------------------------------------------------------------------

def test_top_level_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "{eval,sweep,compare}" in out
    lines = out.splitlines()
    assert any(line.split()[:1] == ["eval"] for line in lines) and any(line.split()[:1] == ["sweep"] for line in lines)


@pytest.mark.parametrize("command, parser, own, foreign", [
    ("eval", eval_parser, ["--checkpoint", "--demo", "--list-tasks", "--max-samples"], ["--watch", "--every"]),
    ("sweep", sweep_parser, ["--watch", "--every", "--wandb-project", "--max-samples"], ["--demo", "--list-tasks"]),
])
def test_subcommand_help_shows_its_own_options_each_with_its_default(capsys, command, parser, own, foreign):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert all(option in out for option in own) and not any(option in out for option in foreign)
    options = [a for a in parser()._actions if a.option_strings and "-h" not in a.option_strings]
    assert out.count("(default") == len(options) + (command == "sweep")  # + the RUN_DIR positional


# ---- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--checkpoint", "ckpt", "--tasks", "demo|arithmetic|0", "--max-samples", "0"], "--max-samples"),
    (["--checkpoint", "ckpt", "--tasks", "demo|arithmetic|0", "--max-samples", "-3"], "--max-samples"),
    (["sweep", "run", "--tasks", "demo|arithmetic|0", "--max-samples", "0"], "--max-samples"),
    (["sweep", "run", "--tasks", "demo|arithmetic|0", "--every", "0"], "--every"),
    (["--checkpoint", "ckpt", "--tasks", "my/tasks.txt"], "file not found: my/tasks.txt"),
    (["--checkpoint", "ckpt", "--tasks", "tasks.yaml"], "file not found: tasks.yaml"),
    (["--checkpoint", "ckpt"], "--tasks"),
])
def test_bad_arguments_are_one_error_line_and_exit_2(capsys, argv, expected):
    assert main(argv) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("nano_eval: error:") and expected in err[0], err


def test_unknown_task_points_at_list_tasks(capsys, tmp_path):
    assert main(["--checkpoint", str(tmp_path), "--tasks", "demo|arithmetc|0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nano_eval: error:") and "--list-tasks" in err and "demo|arithmetic" in err
    assert "Traceback" not in err


def test_list_tasks_shows_supersets(capsys):
    assert main(["--list-tasks"]) == 0
    out = capsys.readouterr().out
    assert "  lighteval|mmlu_mc:anatomy" in out
    superset = next(line for line in out.splitlines() if line.split()[:1] == ["lighteval|mmlu_mc"])
    assert "(57 tasks" in superset
    assert any(line.split()[:1] == ["lighteval|arc"] for line in out.splitlines())


MANY_TASKS = """
from nano_eval.tasks import TaskConfig
from nano_eval.tasks.demo_tasks import arithmetic_choice

TASKS_TABLE = [TaskConfig(name=f"task_{i:05d}_" + "x" * 60, prompt_function=arithmetic_choice, hf_repo="x",
                          metrics=["acc"], suite=["many"]) for i in range(3000)]
"""


def test_broken_pipe_exits_quietly(tmp_path):
    """`nano_eval --list-tasks | head`: the listing (here > 64 KiB, more than a pipe holds) meets a closed pipe."""
    tasks = tmp_path / "many.py"
    tasks.write_text(MANY_TASKS)
    proc = subprocess.Popen([sys.executable, "-m", "nano_eval", "--list-tasks", "--custom-tasks", str(tasks)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout.readline().startswith(b"demo")
    proc.stdout.close()  # the reader is gone, as after `| head -1`
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 141, -13), err.decode()[-2000:]
    assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception ignored" not in err, err.decode()


def test_a_closed_pipe_never_stops_a_run(tmp_path, toy_checkpoint):
    """`nano_eval ... 2>&1 | head -1`: progress bars and the results table meet a closed pipe; the run goes on,
    writes its results and exits 0."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "nano_eval", "--checkpoint", str(toy_checkpoint), "--tasks", TASKS,
                             "--max-samples", "20", "--batch-tokens", "64", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    assert proc.stdout.readline()
    proc.stdout.close()  # the reader is gone, as after `| head -1`
    assert proc.wait(timeout=300) == 0
    assert set(json.loads((out / "results.json").read_text())["results"]) == set(TASKS.split(","))


# ---- entry points --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_entry_point_gives_the_same_results(tmp_path, toy_checkpoint):
    """`python nano_eval/run.py`, `torchrun nano_eval/run.py` and the `nano_eval` console script (when installed)."""
    args = ["--checkpoint", str(toy_checkpoint), "--tasks", TASKS, "--max-samples", "3", "--output-dir"]
    launchers = {
        "script": [sys.executable, RUN_PY],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                     f"--master_port={free_port()}", RUN_PY],
    }
    console = shutil.which("nano_eval")
    if console is not None:
        launchers["console"] = [console]
    results = {}
    for name, launcher in launchers.items():
        proc = subprocess.run([*launcher, *args, str(tmp_path / name)], capture_output=True, text=True, timeout=300,
                              env=ENV)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        results[name] = json.loads((tmp_path / name / "results.json").read_text())["results"]
    first = results.pop("script")
    assert set(first) == set(TASKS.split(","))
    for name, other in results.items():
        assert other == first, name


SYS_PATH_PROBE = """
import json, os, sys
with open(os.environ["NANO_EVAL_SYS_PATH_FILE"], "w") as f:
    json.dump(sys.path, f)
TASKS_TABLE = []
"""


def test_run_py_takes_its_own_folder_off_sys_path(tmp_path):
    """Run as a script, nano_eval/ must not be on sys.path: a module in it would hide an installed package."""
    probe, record = tmp_path / "probe.py", tmp_path / "sys_path.json"
    probe.write_text(SYS_PATH_PROBE)
    proc = subprocess.run([sys.executable, RUN_PY, "--list-tasks", "--custom-tasks", str(probe)], capture_output=True,
                          text=True, timeout=120, env={**ENV, "NANO_EVAL_SYS_PATH_FILE": str(record)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    here = os.path.realpath(REPO / "nano_eval")
    assert all(os.path.realpath(p or os.curdir) != here for p in json.loads(record.read_text()))


@pytest.mark.slow
def test_run_py_sweep_writes_an_offline_wandb_run(tmp_path, toy_checkpoint):
    """The script entry point with W&B: `requests` must be the installed package (W&B needs requests.Session)."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    shutil.copytree(toy_checkpoint, run / "checkpoint-1")
    env = {**ENV, "WANDB_DIR": str(tmp_path / "wandb_dir"), "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    proc = subprocess.run([sys.executable, RUN_PY, "sweep", str(run), "--tasks", "demo|arithmetic|0", "--max-samples",
                           "2", "--settle-s", "0", "--no-report", "--output-dir", str(tmp_path / "out"),
                           "--wandb-project", "p", "--wandb-mode", "offline"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B could not start" not in proc.stderr, proc.stderr[-3000:]
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), proc.stderr[-3000:]


# ---- files for teams -----------------------------------------------------------------------------------------------

@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_result_files_honour_the_umask(tmp_path, toy_checkpoint, umask_022):
    out = tmp_path / "out"
    assert main(["--checkpoint", str(toy_checkpoint), "--tasks", "demo|arithmetic|0", "--max-samples", "2",
                 "--output-dir", str(out)]) == 0
    modes = _modes(out)
    assert "results.json" in modes and "details/demo_arithmetic_0.jsonl" in modes
    assert set(modes.values()) == {0o644}, modes
    from nano_eval.tracking.files import write_json
    from nano_eval.tracking.jsonl import append_jsonl

    os.umask(0o027)  # the mode follows the umask, whatever it is
    write_json(tmp_path / "group.json", {})
    append_jsonl(tmp_path / "group.jsonl", {"step": 1})
    assert _modes(tmp_path)["group.json"] == _modes(tmp_path)["group.jsonl"] == 0o640


def test_toy_checkpoint_honours_the_umask(tmp_path, umask_022):
    from nano_eval.toy import build_toy_checkpoint

    modes = _modes(build_toy_checkpoint(tmp_path / "toy"))
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("name", ["../../escape", "/tmp/absolute", "..", ".", "a/../../b", "x\\..\\y", "", "é" * 300])
def test_file_names_from_task_names_stay_in_their_folder(name):
    safe = safe_file_name(name)
    assert safe and "/" not in safe and "\\" not in safe and not safe.startswith(".") and len(safe) <= 120
    assert os.path.dirname(os.path.normpath(os.path.join("out", safe))) == "out"


ESCAPING_TASKS = """
from nano_eval.tasks import TaskConfig
from nano_eval.tasks.demo_tasks import DEMO_TASKS, arithmetic_choice

DATA = DEMO_TASKS[0].hf_repo
TASKS_TABLE = [TaskConfig(name=name, prompt_function=arithmetic_choice, hf_repo=DATA, metrics=["acc"], suite=["c"])
               for name in ("../../escaped", "/tmp/nano_eval_absolute")]
"""


def test_a_task_name_never_writes_outside_the_output_dir(tmp_path, toy_checkpoint):
    tasks = tmp_path / "escaping.py"
    tasks.write_text(ESCAPING_TASKS)
    out = tmp_path / "a" / "b" / "out"
    before = set(tmp_path.rglob("*"))
    assert main(["--checkpoint", str(toy_checkpoint), "--tasks", "c|../../escaped|0,c|/tmp/nano_eval_absolute|0",
                 "--custom-tasks", str(tasks), "--max-samples", "2", "--output-dir", str(out)]) == 0
    created = {p for p in set(tmp_path.rglob("*")) - before if p.is_file()}
    assert created and all(out in p.parents for p in created), sorted(map(str, created))
    assert sorted(p.name for p in (out / "details").iterdir()) == ["c_.._.._escaped_0.jsonl",
                                                                   "c__tmp_nano_eval_absolute_0.jsonl"]
    assert not Path("/tmp/nano_eval_absolute_0.jsonl").exists()


# ---- output folders ------------------------------------------------------------------------------------------------

def _blocked_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """{case: (--output-dir, what the error line says)}, each blocked by a file or a folder in the way."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "results_dir" / "results.json").mkdir(parents=True)
    (tmp_path / "details_file").mkdir()
    (tmp_path / "details_file" / "details").write_text("")
    return {"is a file": (tmp_path / "a_file", "is a file, not a folder"),
            "inside a file": (tmp_path / "a_file" / "sub" / "out", "a_file is a file, not a folder"),
            "results.json is a folder": (tmp_path / "results_dir", "results.json is a folder"),
            "details is a file": (tmp_path / "details_file", "details is a regular file, not a folder")}


@pytest.mark.parametrize("command", ["eval", "sweep"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_any_model_loads(capsys, tmp_path, command):
    """The checkpoint does not even exist: the output folder is checked first, so nothing is scored in vain."""
    for case, (out, expected) in _blocked_outputs(tmp_path).items():
        if command == "sweep" and case in ("details is a file", "results.json is a folder"):
            continue  # a sweep's results and details live in per-checkpoint folders
        argv = (["--checkpoint", str(tmp_path / "missing")] if command == "eval" else ["sweep", str(tmp_path)])
        assert main([*argv, "--tasks", "demo|arithmetic|0", "--output-dir", str(out)]) == 2, case
        err = _error_lines(capsys.readouterr().err)
        assert len(err) == 1 and err[0].startswith("nano_eval: error:") and expected in err[0], (case, err)
        assert "Fix:" in err[0] and "--output-dir" in err[0], err


def test_a_new_run_replaces_the_details_of_the_last_one(tmp_path, toy_checkpoint):
    """The default output folder is reused run after run: results.json and details/ always belong to one run."""
    out = tmp_path / "out"
    (out / "details").mkdir(parents=True)
    (out / "details" / "notes.txt").write_text("mine")  # not nano_eval's: left alone
    common = ["--checkpoint", str(toy_checkpoint), "--max-samples", "2", "--output-dir", str(out)]
    assert main([*common, "--tasks", "demo|arithmetic|0,demo|arithmetic_ppl|0"]) == 0
    assert main([*common, "--tasks", "demo|arithmetic|3"]) == 0
    assert set(json.loads((out / "results.json").read_text())["results"]) == {"demo|arithmetic|3"}
    assert sorted(p.name for p in (out / "details").iterdir()) == ["demo_arithmetic_3.jsonl", "notes.txt"]
    assert main([*common, "--tasks", "demo|arithmetic|0", "--no-details"]) == 0
    assert sorted(p.name for p in (out / "details").iterdir()) == ["notes.txt"]
