"""nano_eval inside nanotron's DistributedTrainer: a `nano_eval:` section in the training YAML and a trainer mixin.

nanotron's trainer offers hook methods that do nothing by default; the mixin fills them in. In nanotron 0.4 and
main they run in this order:

    __init__ ... post_init()              model, parallel_context and optimizer exist: build the EvalHook (tasks
                                          loaded and tokenised once, on every rank)
    each step:  training_step() ... post_train_step()
                                          `iteration_step` is the step just trained; the consumed counts
                                          (0.4: `consumed_train_samples`, main: `metadata.consumed_tokens_total`)
                                          do not count it yet
                save_checkpoint() ... post_save_checkpoint()   (every checkpoint_interval, after the count)
    post_training()                       close the hook (finishes a W&B run only if the hook opened it)

Every rank calls these hooks at the same steps, which is what EvalHook needs. W&B: nanotron opens its run in
`pre_training` on its logger rank (first rank of the last pipeline stage, not always global rank 0) and logs
`iteration_step` / `consumed_tokens` in every row, so the hook publishes from that rank and uses those keys as
the x-axes: eval charts line up with the loss curve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from nano_eval.training.config import EvalHookConfig, parse_hook_section
from nano_eval.training.hook import EvalHook

SECTION = "nano_eval"
NANOTRON_DEFAULTS = {"step_key": "iteration_step", "tokens_key": "consumed_tokens"}  # nanotron's own W&B keys


@dataclass(frozen=True)
class NanotronEvalOptions:
    """The parsed `nano_eval:` section: the hook's config plus what only the nanotron integration needs."""

    hook: EvalHookConfig
    on_save: bool = False  # also evaluate right after each checkpoint is saved (at most once per step)
    tokenizer: str | None = None  # default: the training config's tokenizer.tokenizer_name_or_path
    # default: the model's max_position_embeddings, as when its checkpoint is scored with run.py (rolling
    # perplexity windows depend on it)
    max_length: int | None = None


EXTRA_KEYS = {f.name for f in fields(NanotronEvalOptions)} - {"hook"} | {"enabled"}


def parse_eval_section(section: Mapping[str, Any] | None, source: str = "the training config") -> NanotronEvalOptions | None:
    """Check and convert the YAML section; None when it is absent or says `enabled: false`.

    Errors name the file, the key and the fix (a typo in a key must not silently turn evaluation off)."""
    parsed = parse_hook_section(section, source, defaults=NANOTRON_DEFAULTS, fixed=("publish_rank",),
                                extra_keys=EXTRA_KEYS - {"enabled"})
    if parsed is None:
        return None
    hook, extra = parsed
    return NanotronEvalOptions(hook=hook, **extra)


def config_class():
    """nanotron's `Config` plus an optional `nano_eval:` mapping. nanotron parses YAML strictly (unknown top-level
    keys fail), so the training config must be read with this class; it is also what checkpoints save."""
    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    from nanotron.config import Config

    return _with_section(Config)


_CLASSES: dict = {}


def _with_section(base):
    if base not in _CLASSES:
        _CLASSES[base] = dataclasses.make_dataclass(
            "ConfigWithNanoEval", [(SECTION, Optional[dict], field(default=None))], bases=(base,)
        )
    return _CLASSES[base]


def load_config(path: str):
    """Read a nanotron training YAML that may hold a `nano_eval:` section, with nanotron's own parser."""
    cls = config_class()  # imports nanotron first, past its import cycle
    from nanotron.config import get_config_from_file

    return get_config_from_file(str(path), config_class=cls)


class NanoEvalTrainerMixin:
    """Evaluation at nanotron's hook points. Put it first: `class T(NanoEvalTrainerMixin, DistributedTrainer)`.

    Reads `self.config.nano_eval` (see `parse_eval_section`); with no section, training runs exactly as without
    the mixin. The built hook is `self.nano_eval_hook` (its `evaluated_steps`, `failed_steps`, `time_share`)."""

    nano_eval_hook: EvalHook | None = None
    nano_eval_options: NanotronEvalOptions | None = None

    def post_init(self):
        super().post_init()
        self.nano_eval_options = parse_eval_section(getattr(self.config, SECTION, None))
        if self.nano_eval_options is not None:
            self.nano_eval_hook = build_hook(self, self.nano_eval_options)

    def post_train_step(self):
        super().post_train_step()
        if self.nano_eval_hook is not None:  # the step just trained is not yet counted (0.4 and main)
            tokens = consumed_tokens(self) + self.global_batch_size * self.sequence_length
            self.nano_eval_hook.maybe_evaluate(self.iteration_step, consumed_tokens=tokens)

    def post_save_checkpoint(self):
        super().post_save_checkpoint()
        hook = self.nano_eval_hook
        if hook is not None and self.nano_eval_options.on_save and hook.last_step != self.iteration_step:
            hook(self.iteration_step, consumed_tokens=consumed_tokens(self))

    def post_training(self):
        super().post_training()
        if self.nano_eval_hook is not None:
            self.nano_eval_hook.close()


def consumed_tokens(trainer) -> int:
    """Training tokens counted so far: nanotron main keeps them in `trainer.metadata.consumed_tokens_total`
    (TrainingMetadata); nanotron 0.4 keeps `trainer.consumed_train_samples` of `sequence_length` tokens each."""
    metadata = getattr(trainer, "metadata", None)
    if metadata is None:
        return trainer.consumed_train_samples * trainer.sequence_length
    if getattr(metadata, "consumed_tokens_total", None) is not None:
        return int(metadata.consumed_tokens_total)
    return metadata.consumed_train_samples * trainer.sequence_length  # main's older checkpoints lack the total


def build_hook(trainer, options: NanotronEvalOptions) -> EvalHook:
    """An EvalHook around the trainer's live model, in its own TP/PP/DP layout."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or trainer.config.tokenizer.tokenizer_name_or_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_length = options.max_length or getattr(trainer.model_config, "max_position_embeddings", None)
    backend = NanotronModel(trainer.unwrapped_model, trainer.parallel_context, tokenizer,
                            max_length=max_length or trainer.sequence_length, device=device)
    publish_rank = int(trainer.logger_ranks[0])  # the rank that holds nanotron's W&B run
    return EvalHook(dataclasses.replace(options.hook, publish_rank=publish_rank), backend)


def trainer_class():
    """`DistributedTrainer` with evaluation (imports nanotron's trainer, which imports flash-attn)."""
    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    from nanotron.trainer import DistributedTrainer

    return type("EvaluatingTrainer", (NanoEvalTrainerMixin, DistributedTrainer), {})
