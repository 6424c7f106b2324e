"""Metric sinks for in-training evaluation: W&B, and TensorBoard when it is installed.

Both are best-effort: a missing package or a failing call prints ONE warning per sink and never raises, so the
local result files (written separately) are always complete.

W&B x-axis. Evaluation results arrive late and sometimes out of order relative to W&B's internal `_step`, which
silently drops `step=` values lower than the last one. So by default we never pass `step=` (`log_step=True` does,
for a trainer that logs every row at step=its iteration itself, as Megatron-LM does): every row carries the trainer's
step under `step_key` (default `train/step`) and consumed tokens under `tokens_key`, and
`define_metric("<prefix>/*", step_metric=step_key)` makes the training step the x-axis of every eval chart.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence


def metric_key(prefix: str, task_key: str, metric: str) -> str:
    """`eval/demo|arithmetic|0/acc`. W&B and TensorBoard accept `|` and `:`; only `/` (a section separator in
    both UIs) and whitespace inside the task key are replaced. Control characters of names from task files are
    escaped (local_files.printable): a key never carries a terminal escape or a line break."""
    from nano_eval.local_files import printable

    safe = "".join("_" if c == "/" or c.isspace() else c for c in printable(task_key))
    return f"{prefix}/{safe}/{printable(metric)}"


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line (pydantic and others put several lines in a message), cut at `limit` chars."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _warn(text: str) -> None:
    print(f"nano_eval: warning: {text}", file=sys.stderr, flush=True)


class WandbLogger:
    """Log eval metrics into the W&B run the trainer already opened (`wandb.run`), or into one we open.

    enabled: None (auto) logs into `wandb.run` if there is one (checked again at every log, so a run the trainer
    opens later is picked up) and opens a run only if `project` is given; True always opens one if none is open;
    False does nothing. A run we opened is finished by `close()`; the trainer's run is left alone.
    """

    def __init__(
        self,
        *,
        enabled: bool | None = None,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        dir: str | None = None,
        step_key: str = "train/step",
        log_step: bool = False,
        tokens_key: str = "train/consumed_tokens",
        prefix: str = "eval",
        init_kwargs: Mapping[str, Any] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        self.step_key, self.tokens_key, self.prefix = step_key, tokens_key, prefix
        self.log_step = log_step  # also pass step= (the trainer logs with step= itself)
        self.run = None
        self.owns_run = False
        self.failures = 0  # failed W&B calls; only the first one is reported
        self._warned = False
        self._disabled = enabled is False
        self._wandb = None
        if self._disabled:
            return
        asked = enabled is True or project is not None
        try:
            import wandb
        except ImportError as e:
            self._disabled = True
            if asked:
                self._fail(f"wandb is not installed ({e}); eval results go to the local files only. "
                           "Fix: pip install wandb")
            return
        self._wandb = wandb
        try:
            if wandb.run is not None:
                self._attach(wandb.run)
            elif asked:
                kwargs = dict(project=project, entity=entity, name=name, mode=mode, dir=dir,
                              config=dict(run_config or {}))
                kwargs.update(init_kwargs or {})
                run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
                self.owns_run = True
                self._attach(run)
        except Exception as e:  # noqa: BLE001 -- any W&B failure must leave training alone
            self._disabled = True
            self._fail(f"W&B could not start ({one_line(e)}); eval results go to the local files only")

    @property
    def active(self) -> bool:
        return self.run is not None and not self._disabled

    def _attach(self, run) -> None:
        run.define_metric(self.step_key)
        run.define_metric(self.tokens_key, step_metric=self.step_key)
        run.define_metric(f"{self.prefix}/*", step_metric=self.step_key)
        self.run = run

    def _fail(self, text: str) -> None:
        self.failures += 1
        if not self._warned:
            self._warned = True
            _warn(text + " (further W&B failures are not reported)")

    def log(self, metrics: Mapping[str, float], step: int, consumed_tokens: int | None = None) -> None:
        """One W&B row: `metrics` plus the step and token counters. Never raises."""
        if self._disabled:
            return
        try:
            if self.run is None:  # auto mode: the trainer may have opened its run after we were built
                if self._wandb.run is None:
                    return
                self._attach(self._wandb.run)
            row = dict(metrics)
            row[self.step_key] = step
            if consumed_tokens is not None:
                row[self.tokens_key] = consumed_tokens
            self.run.log(row, step=step) if self.log_step else self.run.log(row)
        except Exception as e:  # noqa: BLE001
            self._fail(f"W&B logging failed at step {step} ({one_line(e)}); "
                       "eval results still go to the local files")

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """One W&B Table under `key` (a sweep's trend / noise ranking, sweep_signal.csv). Never raises."""
        if self._disabled or self.run is None:
            return
        try:
            self.run.log({key: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
        except Exception as e:  # noqa: BLE001
            self._fail(f"W&B table {key} failed ({one_line(e)}); it is in the local files")

    def close(self) -> None:
        """Finish the run if we opened it. Never raises."""
        run, self.run = self.run, None
        if run is not None and self.owns_run:
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                self._fail(f"W&B run.finish failed ({one_line(e)})")
        self._disabled = True


class TensorBoardLogger:
    """Scalars into a TensorBoard event folder (torch.utils.tensorboard); one warning and nothing else when the
    tensorboard package is missing. TensorBoard keeps every step it is given, in any order."""

    def __init__(self, log_dir: str):
        self.writer = None
        self._warned = False
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            _warn(f"TensorBoard logging skipped: {e}. Fix: pip install tensorboard")
            return
        try:
            self.writer = SummaryWriter(log_dir=log_dir)
        except Exception as e:  # noqa: BLE001
            _warn(f"TensorBoard logging skipped: {one_line(e)}")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        try:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                _warn(f"TensorBoard logging failed at step {step} ({one_line(e)}); not reported again")

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass
