"""nano_eval inside Megatron-LM's `pretrain`: benchmark scores of the live model at every validation.

```python
from nano_eval.training.config import EvalHookConfig
from nano_eval.training.megatron import make_non_loss_data_func

nano_eval_hook = make_non_loss_data_func(EvalHookConfig(tasks="lighteval|hellaswag|0", max_samples=500,
                                                        output_dir="eval", wandb_project="my-run"), tokenizer)
pretrain(..., forward_step_func, non_loss_data_func=nano_eval_hook)  # keyword: positions differ across releases
nano_eval_hook.close()
```

The route, and why:
- `pretrain` -> `train` -> `evaluate_and_print_results` -> `evaluate(...)` calls `non_loss_data_func(model)` on
  EVERY rank, at every `--eval-interval` iteration (and after training), once Megatron's own validation loss
  loop is done, with the model chunks in eval mode under torch.no_grad. Every TP/PP/DP rank is there, so our
  collectives (TP reductions, the PP schedule, the DP gather) all have their peers. It only runs when validation
  runs: a validation set and `--eval-iters > 0`.
- Not `process_non_loss_data_func`: Megatron runs its forward_backward_func for it on the last rank only
  (`is_last_rank()`) and then calls it there with a TensorBoard writer; a model split over TP or PP would wait
  forever for the other ranks, and it only sees Megatron's own validation batches.
- `model` is the trainer's list of chunks (DDP / Float16Module wrapped); the first call builds a `MegatronModel`
  around it and an `EvalHook` (tasks tokenised once), later calls only score.
- The step is the iteration just trained, the one Megatron logs the validation loss at. `train()` sets
  `args.curr_iteration = iteration` BEFORE the train step and evaluates after `iteration += 1`, so the step is
  `curr_iteration + 1` (never below `args.iteration`, the iteration the run resumed from); with `--skip-train` it
  is `args.iteration`. Consumed tokens are `consumed_train_samples x seq_length` (already counted for this
  iteration when evaluate() runs), else `step x global_batch_size x seq_length`. Args come from
  `megatron.training.get_args()`, or from `get_args=` / `get_iteration=` outside Megatron-LM's pretrain (where
  megatron.training is not importable, or, as the megatron-core 0.17+ wheel ships it, importable with no args set:
  nano_eval.compat.megatron.megatron_lm_args).
- One evaluation per iteration: after training Megatron calls evaluate() for the validation set and then the test
  set (and once per validation set with --multiple-validation-sets), each calling non_loss_data_func at the same
  iteration; later calls at an iteration already evaluated return its results without scoring or writing again.
- Results are published from global rank world_size - 1, where Megatron-LM keeps its W&B writer (`wandb.run` is
  open there only), with `step=iteration` as Megatron logs everything: logging without it would push W&B's step
  past the iteration and drop the validation loss Megatron logs right after, at that same iteration.
  Failures follow EvalHookConfig.fail_soft (training goes on by default).
- Tasks are loaded when the hook is made, before training starts: a typo in a task spec or missing data stops the
  job at start-up, not at the first validation hours later. Building the scorer around the model happens at the
  first call; if that fails with fail_soft, the failure is reported and the next validation tries again.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch.distributed as dist

from nano_eval.compat.megatron import megatron_lm_args, unwrap
from nano_eval.tasks import load_tasks
from nano_eval.tracking.wandb_logger import one_line
from nano_eval.training.config import EvalHookConfig
from nano_eval.training.hook import EvalHook, HookResults
from nano_eval.local_files import printable


def trained_iteration(args) -> int:
    """The iteration just trained, from Megatron-LM's args (see the module docstring)."""
    if getattr(args, "skip_train", False):
        return int(getattr(args, "iteration", 0))
    current = getattr(args, "curr_iteration", None)
    resumed = int(getattr(args, "iteration", 0) or 0)
    return resumed if current is None else max(int(current) + 1, resumed)


def consumed_tokens(args, iteration: int) -> int | None:
    """Tokens trained on so far: counted samples x seq_length, else iteration x global batch x seq_length."""
    seq = getattr(args, "seq_length", None)
    if seq is None:
        return None
    samples = getattr(args, "consumed_train_samples", None)
    if samples:
        return int(samples) * seq
    gbs = getattr(args, "global_batch_size", None)
    return iteration * gbs * seq if gbs else None


class MegatronEvalHook:
    """`non_loss_data_func` for Megatron-LM's pretrain: `hook(model)` evaluates at the iteration just trained."""

    def __init__(self, config: EvalHookConfig, tokenizer, *, max_length: int | None = None,
                 get_args: Callable[[], object] | None = None, get_iteration: Callable[[], int] | None = None,
                 tokens_per_iteration: int | None = None, micro_batch_size: int | None = None, pg_collection=None):
        """get_args: returns Megatron-LM's args (default: megatron.training.get_args). get_iteration: the step
        itself, for loops without Megatron-LM's args; tokens_per_iteration (global batch x seq length) goes with it.
        Results are published from the last global rank (Megatron's W&B writer): config.publish_rank is replaced."""
        self.config = dataclasses.replace(config, wandb_log_step=True)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.get_args, self.get_iteration = get_args or megatron_lm_args, get_iteration
        self.tokens_per_iteration = tokens_per_iteration
        self.micro_batch_size, self.pg_collection = micro_batch_size, pg_collection
        self.hook: EvalHook | None = None
        self.backend = None
        self.last: tuple[int, HookResults | None] | None = None  # (step, its results) of the latest evaluation
        # before training: bad specs and missing data fail here, at once; with fail_soft a task with unscorable
        # documents is skipped with a warning (as EvalHook does), otherwise it fails here too
        bad: dict[str, str] | None = {} if config.fail_soft else None
        self.tasks = load_tasks(config.tasks, custom_tasks=config.custom_tasks, data_dir=config.data_dir,
                                bad_documents=bad, lm_eval_include_path=config.lm_eval_include_path)
        self.bad_tasks = bad or {}
        if not dist.is_initialized() or dist.get_rank() == config.publish_rank:
            for name, why in self.bad_tasks.items():
                print(f"nano_eval: warning: task {name} is skipped by the evaluation hook (fail_soft=True): "
                      f"{printable(why)}",
                      file=sys.stderr, flush=True)

    def __call__(self, model) -> HookResults | None:
        """Called by Megatron's evaluate() on every rank. Returns the results (None if it failed, fail_soft); a
        second call at the same iteration (the test set after the validation set) returns the first one's."""
        step, tokens = self._progress()
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        if self.hook is None:
            try:
                self._build(model)
            except Exception as e:  # EvalHook agrees on build failures: every rank lands here together
                if not self.config.fail_soft:
                    raise
                print(f"nano_eval: warning: building the evaluation at iteration {step} failed: {one_line(e)}; "
                      "training continues (fail_soft=True) and the next validation tries again", file=sys.stderr)
                return None
        self.last = (step, self.hook(step, tokens))
        return self.last[1]

    def _build(self, model) -> None:
        from nano_eval.backends.megatron import MegatronModel

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        args = self.get_args() if self.get_iteration is None else None
        max_length = (self.max_length or getattr(unwrap(chunks[0]), "max_sequence_length", None)
                      or getattr(args, "seq_length", None))
        if not max_length:
            raise ValueError("cannot tell the model's context length. Fix: pass max_length=... to the hook.")
        self.backend = MegatronModel(chunks, self.tokenizer, max_length=max_length, pg_collection=self.pg_collection,
                                     micro_batch_size=self.micro_batch_size)
        writer_rank = dist.get_world_size() - 1 if dist.is_initialized() else 0  # Megatron's W&B writer rank
        config = dataclasses.replace(self.config, publish_rank=writer_rank)
        self.hook = EvalHook(config, self.backend, tasks=self.tasks)  # collective: every rank builds it

    def _progress(self) -> tuple[int, int | None]:
        if self.get_iteration is not None:
            step = int(self.get_iteration())
            return step, step * self.tokens_per_iteration if self.tokens_per_iteration else None
        args = self.get_args()
        if args is None:
            raise RuntimeError("Megatron-LM's args are not there (megatron.training is not importable, or "
                               "its get_args() was never initialised), so the iteration is unknown. "
                               "Fix: pass get_args=... (Megatron's args) or get_iteration=... to "
                               "make_non_loss_data_func.")
        step = trained_iteration(args)
        return step, consumed_tokens(args, step)

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()


def make_non_loss_data_func(config: EvalHookConfig, tokenizer, *, max_length: int | None = None,
                            get_args: Callable[[], object] | None = None,
                            get_iteration: Callable[[], int] | None = None, tokens_per_iteration: int | None = None,
                            micro_batch_size: int | None = None, pg_collection=None) -> MegatronEvalHook:
    """The callable to pass as `pretrain(..., non_loss_data_func=...)`; see MegatronEvalHook for the options."""
    return MegatronEvalHook(config, tokenizer, max_length=max_length, get_args=get_args, get_iteration=get_iteration,
                            tokens_per_iteration=tokens_per_iteration, micro_batch_size=micro_batch_size,
                            pg_collection=pg_collection)
