"""The nanotron integration: the `nano_eval:` YAML section, and hooks/nanotron_eval.py running nanotron 0.4's REAL
DistributedTrainer with NanoEvalTrainerMixin under torchrun on 2 CPU processes (tp2 by default; pp2 and dp2 are
slow-marked), through tests/nanotron_cpu_launch.py (flash-attn test double + CPU patches, test-only).

Each layout trains 4 steps twice, with and without the `nano_eval:` section (interval 2, on_save, checkpoint at
step 3): the losses nanotron logs to W&B must be bitwise identical; evaluations land at steps 2, 3, 4 in the
JSONL and in nanotron's own offline W&B run on `iteration_step` with `consumed_tokens`; and the live scores at
step 3 equal run.py on the step-3 checkpoint, read through the transformers conversion and, under torchrun,
with `--backend nanotron`. The evaluations include lm-evaluation-harness tasks (tests/lm_eval_layouts.py: few-shot
multiple choice, filtered greedy generation, rolling perplexity) when lm-eval is installed; their live step-3
details (request strings, per-request log-probs, generations) equal run.py's on the checkpoint too.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nanotron")
wandb = pytest.importorskip("wandb")

from nano_eval.errors import NanoEvalError  # noqa: E402
from nano_eval.tracking.jsonl import read_jsonl  # noqa: E402
from nano_eval.training.nanotron import load_config, parse_eval_section  # noqa: E402
from tests.lm_eval_layouts import SPECS as LM_EVAL_SPECS  # noqa: E402
from tests.lm_eval_layouts import assert_same_lm_eval, worst_logprob_gap  # noqa: E402
from tests.nanotron_worker import write_config  # noqa: E402
from tests.test_wandb import read_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanotron_eval.yaml"
TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
STEPS, SAVE_AT, SEQ, MICRO_BATCH, SAMPLES = 4, 3, 32, 2, 6
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict(dp=2)}
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None


def eval_tasks(include: Path) -> tuple[str, list[str]]:
    """The hook's and run.py's tasks: TASKS, and lm-eval's (YAMLs in `include`, conftest.py's lm_eval_include_dir)
    when it is installed; and the command-line options they need."""
    if not HAS_LM_EVAL:
        return TASKS, []
    return f"{TASKS},{LM_EVAL_SPECS}", ["--lm-eval-include-path", str(include)]


def test_example_yaml_parses_with_nanotrons_parser():
    config = load_config(EXAMPLE)
    options = parse_eval_section(config.nano_eval, source=str(EXAMPLE))
    assert options.hook.every_n_steps == 40 and options.hook.also_at_steps == (1,) and options.hook.max_samples == 100
    assert options.hook.tasks == "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"
    assert (options.hook.step_key, options.hook.tokens_key) == ("iteration_step", "consumed_tokens")  # nanotron's keys
    assert config.parallelism.tp == 2 and config.tokens.sequence_length == 64


def test_plain_nanotron_config_rejects_the_section(tmp_path):
    """Why `load_config` / `config_class()` exist: nanotron's parser is strict about top-level keys."""
    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    from nanotron.config import get_config_from_file

    with pytest.raises(Exception, match="nano_eval"):
        get_config_from_file(str(EXAMPLE))


@pytest.mark.parametrize("section, message", [
    ({"tasks": "demo|arithmetic|0", "intreval": 5}, r"intreval \(did you mean interval\?\)"),
    ({"interval": 5}, "needs `tasks:`"),
    ({"tasks": "demo|arithmetic|0", "interval": -1}, "every_n_steps must be a positive integer"),
    ("tasks: x", "must be a mapping"),
])
def test_bad_sections_fail_with_the_key_and_the_fix(section, message):
    with pytest.raises(NanoEvalError, match=message):
        parse_eval_section(section, source="train.yaml")


def test_section_switches():
    assert parse_eval_section(None) is None
    assert parse_eval_section({"enabled": False, "tasks": "demo|arithmetic|0"}) is None
    options = parse_eval_section({"tasks": ["demo|arithmetic|0", "demo|arithmetic_ppl|0"], "samples": 3,
                                  "on_save": True, "step_key": "train/step"})
    assert options.on_save and options.hook.max_samples == 3 and options.hook.tasks == TASKS
    assert options.hook.step_key == "train/step"  # the user's choice wins over nanotron's default


def torchrun(nproc: int, script: str, *args: str, cwd: Path, timeout: int = 300) -> str:
    """`torchrun --nproc_per_node=N tests/nanotron_cpu_launch.py SCRIPT ARGS` (offline W&B under cwd); the log."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           "WANDB_DIR": str(cwd), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    from tests.dist_utils import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(REPO / "tests" / "nanotron_cpu_launch.py"), str(REPO / script), *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


def train(tmp: Path, tokenizer_dir: str, layout: str, with_eval: bool, lm_eval_dir: Path) -> Path:
    run = tmp / f"{layout}_{'with' if with_eval else 'without'}_eval"
    run.mkdir()
    tasks, options = eval_tasks(lm_eval_dir)
    section = {"tasks": tasks, "interval": 2, "on_save": True, "max_samples": SAMPLES, "batch_tokens": 512,
               "output_dir": str(run / "eval"), "write_details": True,
               **({"lm_eval_include_path": options[1]} if options else {})} if with_eval else None
    config = write_config(run / "train.yaml", tokenizer_dir, run, nano_eval=section, train_steps=STEPS,
                          micro_batch_size=MICRO_BATCH, sequence_length=SEQ, **LAYOUTS[layout])
    text = yaml.safe_load(config.read_text())
    text["checkpoints"]["checkpoint_interval"] = SAVE_AT
    config.write_text(yaml.safe_dump(text, sort_keys=False))
    torchrun(2, "hooks/nanotron_eval.py", "--config-file", str(config), cwd=run)
    return run


def runs_for(tmp: Path, tokenizer_dir: str, layout: str, lm_eval_dir: Path) -> dict:
    return {"layout": layout, "lm_eval_dir": lm_eval_dir, "with": train(tmp, tokenizer_dir, layout, True, lm_eval_dir),
            "without": train(tmp, tokenizer_dir, layout, False, lm_eval_dir)}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, toy_checkpoint, lm_eval_include_dir):
    return runs_for(tmp_path_factory.mktemp("nanotron_trainer"), str(toy_checkpoint), "tp2", lm_eval_include_dir)


def check_training_is_bitwise_identical(runs):
    losses = {k: [r["lm_loss"] for r in read_run(runs[k], finished=False)[0] if "lm_loss" in r] for k in ("with", "without")}
    assert len(losses["with"]) == STEPS and len(set(losses["with"])) > 1
    assert losses["with"] == losses["without"]  # exact float equality, every step


def check_evaluations_and_wandb_rows(runs):
    global_batch = MICRO_BATCH * (2 if runs["layout"] == "dp2" else 1)
    expected_tokens = [s * global_batch * SEQ for s in (2, 3, 4)]
    rows = read_jsonl(runs["with"] / "eval" / "eval_results.jsonl")
    assert [r["step"] for r in rows] == [2, 3, 4]  # interval 2 -> 2, 4; on_save -> 3
    assert [r["consumed_tokens"] for r in rows] == expected_tokens
    history, step_metrics = read_run(runs["with"], finished=False)
    assert step_metrics["eval/*"] == "iteration_step"
    assert [r["iteration_step"] for r in history if "lm_loss" in r] == list(range(1, STEPS + 1))
    eval_rows = [r for r in history if "eval/demo|arithmetic|0/acc" in r]
    assert [r["iteration_step"] for r in eval_rows] == [2, 3, 4]
    assert [r["consumed_tokens"] for r in eval_rows] == expected_tokens
    assert not any("eval/demo|arithmetic|0/acc" in r for r in read_run(runs["without"], finished=False)[0])


def live_and_posthoc(runs, native: bool) -> tuple[dict, dict]:
    """The live scores at step SAVE_AT and run.py's on the step-SAVE_AT checkpoint (transformers conversion in this
    process, or --backend nanotron under torchrun at tp2)."""
    from nano_eval.cli import main

    live = {r["step"]: r["results"] for r in read_jsonl(runs["with"] / "eval" / "eval_results.jsonl")}[SAVE_AT]
    ckpt = runs["with"] / "checkpoints" / str(SAVE_AT)
    out = posthoc_dir(runs, native)
    tasks, options = eval_tasks(runs["lm_eval_dir"])
    args = ["--checkpoint", str(ckpt), "--tasks", tasks, "--max-samples", str(SAMPLES), "--output-dir", str(out),
            *options]
    if native:
        torchrun(2, "nano_eval/run.py", *args, "--backend", "nanotron", "--tp", "2", cwd=runs["with"])
    else:
        assert main(args) == 0
    return live, json.loads((out / "results.json").read_text())["results"]


def posthoc_dir(runs, native: bool) -> Path:
    return runs["with"] / ("posthoc_native" if native else "posthoc_hf")


def lm_eval_details(folder: Path, results: dict) -> dict:
    """tests/lm_eval_layouts.py's summary of the lm-eval tasks from an output folder's details/ and its results."""
    from nano_eval.tracking.files import details_file_name

    return {key: {"metrics": {k: v for k, v in results[key].items() if "_stderr" not in k},
                  "rows": [{k: row[k] for k in ("doc_index", "filter", "arguments", "resps", "filtered_resps")}
                           for row in read_jsonl(folder / "details" / details_file_name(key))]}
            for key in results if key.startswith("lm_eval|")}


def check_lm_eval_live_equals_posthoc(runs, native: bool, live: dict, saved: dict) -> None:
    """The lm-eval tasks' live step-SAVE_AT details (the hook's write_details) equal run.py's on the checkpoint, per
    request: the same request strings (few-shot contexts), log-probs within 1e-5, generations, filtered answers."""
    if not HAS_LM_EVAL:
        return
    got = lm_eval_details(posthoc_dir(runs, native), saved)
    live_details = lm_eval_details(runs["with"] / "eval" / f"step_{SAVE_AT}", live)
    assert list(live_details) == [k.strip() for k in LM_EVAL_SPECS.split(",")]
    assert_same_lm_eval(got, live_details, f"{runs['layout']} run.py vs live")
    print(f"{runs['layout']} lm-eval live vs {'--backend nanotron' if native else 'HF conversion'}: log-probs within "
          f"{worst_logprob_gap(got, live_details):.1e}")


def check_live_equals_posthoc(live, saved, rel):
    worst = 0.0
    for task, metrics in live.items():
        for name, value in metrics.items():
            if "_stderr" in name:  # nano_eval's `acc_stderr`, lm-eval's `acc_stderr,none` (N/A for perplexities)
                continue
            assert saved[task][name] == pytest.approx(value, rel=rel, abs=1e-9), (task, name)
            worst = max(worst, abs(saved[task][name] - value) / max(abs(value), 1e-12))
    return worst


def test_training_is_bitwise_identical_with_and_without_evaluation(tp2):
    check_training_is_bitwise_identical(tp2)


def test_evaluates_at_interval_and_on_save_into_nanotrons_wandb_run(tp2):
    check_evaluations_and_wandb_rows(tp2)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["hf_conversion", "backend_nanotron"])
def test_live_scores_at_step_k_equal_run_py_on_the_step_k_checkpoint(tp2, native):
    live, saved = live_and_posthoc(tp2, native)
    worst = check_live_equals_posthoc(live, saved, rel=1e-6)
    check_lm_eval_live_equals_posthoc(tp2, native, live, saved)
    print(f"tp2 live vs {'--backend nanotron' if native else 'HF conversion'} at step {SAVE_AT}: max rel diff {worst:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_other_layouts_train_evaluate_and_match_their_checkpoint(tmp_path, toy_checkpoint, lm_eval_include_dir,
                                                                  layout):
    runs = runs_for(tmp_path, str(toy_checkpoint), layout, lm_eval_include_dir)
    check_training_is_bitwise_identical(runs)
    check_evaluations_and_wandb_rows(runs)
    for native in (False, True):
        live, saved = live_and_posthoc(runs, native)
        worst = check_live_equals_posthoc(live, saved, rel=1e-6)
        check_lm_eval_live_equals_posthoc(runs, native, live, saved)
        print(f"{layout} live vs {'--backend nanotron' if native else 'HF conversion'} at step {SAVE_AT}: "
              f"max rel diff {worst:.1e}")


def test_the_trainers_tp2_checkpoint_is_sharded_as_nanotron_writes_it(tp2):
    """What the readers above rely on: one safetensors file per TP shard with its slice metadata (under numpy 2,
    shapes as numpy scalar reprs, which nano_eval.compat teaches load_weights to read), replicated weights once."""
    from safetensors import safe_open

    ckpt = tp2["with"] / "checkpoints" / str(SAVE_AT)
    assert (ckpt / "checkpoint_metadata.json").is_file() and "nano_eval" in yaml.safe_load((ckpt / "config.yaml").read_text())
    qkv = ckpt / "model" / "model" / "decoder" / "0" / "pp_block" / "attn" / "qkv_proj"
    shards = sorted(p.name for p in qkv.iterdir())
    assert shards == [f"model_weight_pp-rank-0-of-1_tp-rank-{r}-of-2.safetensors" for r in (0, 1)]
    with safe_open(qkv / shards[1], framework="pt") as f:
        assert f.get_tensor("data").shape == (64, 64)  # (q + k + v rows = 64 + 32 + 32) / tp
        assert f.metadata()["unsharded_shape"].replace("np.int64(128)", "128") == "(128, 64)"
    norm = ckpt / "model" / "model" / "decoder" / "0" / "pp_block" / "input_layernorm"
    assert sorted(p.name for p in norm.iterdir()) == ["model_weight.safetensors"]
