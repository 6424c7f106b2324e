"""nano_eval inside torchtitan's Trainer: options from a `--nano-eval FILE` YAML and a trainer mixin.

torchtitan's `Trainer.train()` runs, per step: `train_step()` (the optimizer step; `self.step` is the step just
trained, `self.ntokens_seen` counts this rank's tokens), then `checkpointer.save(step)` (True when it wrote one),
then its loss-only validator. The mixin adds, on every rank:

    __init__       after torchtitan builds the model, meshes, schedule and checkpointer: the EvalHook (tasks loaded
                   and tokenised once) around `TorchtitanModel` (nano_eval.backends.torchtitan)
    train_step     then evaluate at the interval (`every_n_steps`, `also_at_steps`)
    checkpointer.save  then, when a checkpoint was written and `on_save`, evaluate at that step (once per step) and
                   write `nano_eval_torchtitan.json` (the model's registry names) into the checkpoint folder, so
                   `run.py --checkpoint` rebuilds the same model
    close          close the hook (a W&B run it opened)

Results go into torchtitan's own W&B run (opened by its metrics processor on the logging rank: rank 0, or the first
rank of the last pipeline stage) at `step=` the training step, as torchtitan logs its losses, with consumed tokens
under torchtitan's own `n_tokens_seen`; into its TensorBoard folder when that is on; and into
`<output_dir>/eval_results.jsonl` / `step_<N>/results.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from nano_eval.checkpoints.torchtitan import MODEL_FILE  # in each checkpoint folder: the model's registry names
from nano_eval.errors import NanoEvalError
from nano_eval.training.config import EvalHookConfig, parse_hook_section
from nano_eval.training.hook import EvalHook

TORCHTITAN_DEFAULTS = {"wandb_log_step": True, "tokens_key": "n_tokens_seen"}  # torchtitan logs every row at step=
YAML_BYTES = 1 << 20


@dataclass(frozen=True)
class TorchtitanEvalOptions:
    """The parsed `--nano-eval` file: the hook's config plus what only the torchtitan integration needs."""

    hook: EvalHookConfig
    on_save: bool = True  # also evaluate right after each checkpoint torchtitan saves (at most once per step)
    tokenizer: str | None = None  # default: torchtitan's hf_assets_path (its tokenizer folder)
    max_length: int | None = None  # default: training.seq_len (torchtitan sizes its RoPE cache to it)
    unshard: bool | str = "auto"  # FSDP2 parameters gathered once per evaluation (see backends/torchtitan.py)


EXTRA_KEYS = {f.name for f in fields(TorchtitanEvalOptions)} - {"hook"}


def parse_options(section: Mapping[str, Any] | None, source: str = "--nano-eval") -> TorchtitanEvalOptions | None:
    """The `--nano-eval` YAML (the same keys as nanotron's `nano_eval:` section, plus `unshard`); None when it says
    `enabled: false`."""
    parsed = parse_hook_section(section, source, defaults=TORCHTITAN_DEFAULTS, fixed=("publish_rank",),
                                extra_keys=EXTRA_KEYS)
    if parsed is None:
        return None
    hook, extra = parsed
    if extra.get("unshard", "auto") not in (True, False, "auto"):
        raise NanoEvalError(f"{source}: `unshard:` must be true, false or auto, got {extra['unshard']!r}")
    return TorchtitanEvalOptions(hook=hook, **extra)


def read_options(path: str | os.PathLike) -> TorchtitanEvalOptions | None:
    """Read and check a `--nano-eval` YAML file: the options at its top level, or under a `nano_eval:` key."""
    import yaml

    from nano_eval.local_files import printable, read_text

    try:
        data = yaml.safe_load(read_text(path, YAML_BYTES))
    except (OSError, yaml.YAMLError) as e:
        raise NanoEvalError(f"{printable(str(path))}: cannot read the --nano-eval file ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}). Fix: pass a YAML file of nano_eval options") from e
    if isinstance(data, Mapping) and set(data) == {"nano_eval"}:
        data = data["nano_eval"]
    return parse_options(data, source=printable(str(path)))


class NanoEvalTrainerMixin:
    """Evaluation at torchtitan's step and checkpoint points. Put it first:
    `class T(NanoEvalTrainerMixin, Trainer)`, and set `T.nano_eval_options` (or pass `nano_eval_options=` to
    `trainer_class`) before building it. The built hook is `self.nano_eval_hook`."""

    nano_eval_options: TorchtitanEvalOptions | None = None
    nano_eval_hook: EvalHook | None = None
    nano_eval_model: dict | None = None  # {"module", "config"}: written next to each checkpoint (run.py reads it)

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.nano_eval_options is not None:
            self.nano_eval_hook = build_hook(self, self.nano_eval_options)
            save = self.checkpointer.save
            self.checkpointer.save = lambda step, last_step=False: self._nano_eval_after_save(save, step, last_step)

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        if self.nano_eval_hook is not None:
            self.nano_eval_hook.maybe_evaluate(self.step, consumed_tokens=consumed_tokens(self))

    def _nano_eval_after_save(self, save, step: int, last_step: bool) -> bool:
        saved = save(step, last_step=last_step)
        if saved:
            write_model_file(self, step)
            hook = self.nano_eval_hook
            if self.nano_eval_options.on_save and hook.last_step != step:
                hook(step, consumed_tokens=consumed_tokens(self))
        return saved

    def close(self):
        try:
            super().close()
        finally:
            if self.nano_eval_hook is not None:
                self.nano_eval_hook.close()


def trainer_class(base=None, nano_eval_options: TorchtitanEvalOptions | None = None, model: dict | None = None):
    """`base` (torchtitan's Trainer, or your subclass of it) with evaluation. `model`: {"module", "config"}, the
    names `--module` / `--config` gave (written next to every checkpoint)."""
    if base is None:
        from torchtitan.trainer import Trainer as base
    return type(f"Evaluating{base.__name__}", (NanoEvalTrainerMixin, base),
                {"nano_eval_options": nano_eval_options, "nano_eval_model": model})


def consumed_tokens(trainer) -> int:
    """Training tokens seen by all data-parallel (and context-parallel) ranks together: torchtitan counts each
    rank's own in `ntokens_seen` (labels after CP sharding); every such rank sees as many."""
    pd = trainer.parallel_dims
    return int(trainer.ntokens_seen) * pd.dp_replicate * pd.dp_shard * pd.cp


def publish_rank(trainer) -> int:
    """The rank holding torchtitan's W&B / TensorBoard logger (its metrics processor's choice)."""
    pd = trainer.parallel_dims
    if pd.pp <= 1 or trainer.config.parallelism.pipeline_parallel_schedule == "ZBVZeroBubble":
        return 0
    return (pd.world_size // pd.pp) * (pd.pp - 1)


def build_hook(trainer, options: TorchtitanEvalOptions) -> EvalHook:
    """An EvalHook around the trainer's live model parts, in its own layout."""
    from transformers import AutoTokenizer

    from nano_eval.backends.torchtitan import TorchtitanModel

    config = trainer.config
    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or config.hf_assets_path)
    schedule = getattr(trainer, "pp_schedule", None) if trainer.parallel_dims.pp > 1 else None
    backend = TorchtitanModel(trainer.model_parts, trainer.parallel_dims, tokenizer,
                              max_length=options.max_length or config.training.seq_len, schedule=schedule,
                              sequence_parallel=config.parallelism.enable_sequence_parallel,
                              unshard=options.unshard, device=trainer.device)
    hook = dataclasses.replace(options.hook, publish_rank=publish_rank(trainer))
    if hook.tensorboard_dir is None:
        hook = dataclasses.replace(hook, tensorboard_dir=_tensorboard_dir(trainer))
    return EvalHook(hook, backend)


def _tensorboard_dir(trainer) -> str | None:
    """torchtitan's TensorBoard folder on this rank (its metrics processor's writer), None when it logs none here."""
    loggers = getattr(trainer.metrics_processor.logger, "_loggers", [])
    writers = [getattr(lg, "writer", None) for lg in loggers]
    return next((w.log_dir for w in writers if w is not None and hasattr(w, "log_dir")), None)


def write_model_file(trainer, step: int) -> None:
    """Rank 0: `<checkpoint folder>/nano_eval_torchtitan.json` with the model's registry names and the step, so
    run.py rebuilds the model the checkpoint holds. Never fails training (a warning instead)."""
    import torch.distributed as dist

    model = trainer.nano_eval_model
    folder = getattr(trainer.checkpointer, "folder", None)
    if model is None or folder is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    from nano_eval.local_files import atomic_write_bytes

    path = Path(folder) / f"step-{step}"
    document = {"module": model["module"], "config": model["config"], "step": step,
                "consumed_tokens": consumed_tokens(trainer), "seq_len": trainer.config.training.seq_len,
                "tokenizer": str(trainer.config.hf_assets_path)}
    try:
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path / MODEL_FILE, json.dumps(document, indent=1).encode())
    except OSError as e:
        print(f"nano_eval: warning: could not write {path / MODEL_FILE} ({e}); score this checkpoint with "
              f"--torchtitan-config {model['module']}:{model['config']}", flush=True)
