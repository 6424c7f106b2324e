"""A CPU stand-in for nanotron's DistributedTrainer, to run the nanotron integration where nanotron's trainer cannot.

nanotron 0.4's `DistributedTrainer` imports flash-attn and builds CUDA models, so it cannot run on a CPU machine.
This class keeps exactly what `NanoEvalTrainerMixin` relies on: the attribute names (`config`, `parallel_context`,
`unwrapped_model`, `iteration_step`, `consumed_train_samples`, `global_batch_size`, `sequence_length`,
`logger_ranks`), the order of the hook methods, a W&B run opened in `pre_training` on the logger rank with
nanotron's row keys, and checkpoints written with nanotron's own `save_weights`. The model is the toy Llama built
from nanotron's parallel modules (tests/toy_nanotron.py), trained in TP x DP (pipeline training needs
nanotron's pipeline engine, which needs CUDA) on arithmetic text, with nanotron's `sharded_cross_entropy`.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist

from nano_eval.compat.nanotron import cpu_parallel_context, import_nanotron
from nano_eval.toy import arithmetic_line
from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model


class ToyNanotronTrainer:
    """Trains the toy nanotron model from a nanotron YAML (read with nanotron's parser); hooks as in nanotron 0.4."""

    def __init__(self, config_file: str, config_class=None):
        import_nanotron()
        from nanotron.config import get_config_from_file
        from transformers import AutoTokenizer

        self.config = get_config_from_file(str(config_file), config_class=config_class or _plain_config())
        par, tokens = self.config.parallelism, self.config.tokens
        if par.pp != 1:
            raise ValueError("the CPU stand-in trains with pp=1 (pipeline training needs nanotron's CUDA engine)")
        self.parallel_context = cpu_parallel_context(tp=par.tp, pp=1, dp=par.dp)
        self.model_config = ToyConfig(**_toy_fields(self.config.model.model_config))
        self.unwrapped_model = self.model = build_toy_nanotron_model(self.parallel_context, self.model_config,
                                                                     seed=self.config.general.seed)
        lr = self.config.optimizer.learning_rate_scheduler.learning_rate
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer.tokenizer_name_or_path)
        self.micro_batch_size = tokens.micro_batch_size
        self.global_batch_size = tokens.micro_batch_size * tokens.batch_accumulation_per_replica * par.dp
        self.sequence_length = tokens.sequence_length
        self.iteration_step = self.start_iteration_step = 0
        self.consumed_train_samples = 0
        self.logger_ranks = [int(self.parallel_context.world_rank_matrix[0, 0, 0, 0])]  # last (only) PP stage
        self.losses: list[float] = []
        self.wandb_run = None
        self.post_init()

    # nanotron's hook methods: empty here, filled in by mixins
    def post_init(self): ...
    def post_train_step(self): ...
    def pre_save_checkpoint(self): ...
    def post_save_checkpoint(self): ...
    def post_training(self): ...

    def pre_training(self):
        """As nanotron: the logger rank opens a W&B run (mode from WANDB_MODE) with the config attached."""
        if dist.get_rank() == self.logger_ranks[0]:
            try:
                import wandb
            except ImportError:
                return
            folder = Path(self.config.checkpoints.checkpoints_path)
            folder.mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(project=self.config.general.project, name=self.config.general.run,
                                        dir=str(folder), config={"nanotron_config": self.config.as_dict()})

    def train(self) -> list[float]:
        """The training loop of nanotron 0.4's `DistributedTrainer.train`, with the same hook order."""
        self.pre_training()
        batches = self._batches()
        for self.iteration_step in range(self.start_iteration_step + 1, self.config.tokens.train_steps + 1):
            loss = self.training_step(next(batches))
            self.consumed_train_samples += self.global_batch_size
            self.losses.append(loss)
            self._log(loss)
            if self.iteration_step % self.config.checkpoints.checkpoint_interval == 0:
                self.save_checkpoint()
        dist.barrier()
        self.post_training()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        return self.losses

    def training_step(self, batch: torch.Tensor) -> float:
        from nanotron.parallel.tensor_parallel.functional import sharded_cross_entropy

        pc = self.parallel_context
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model.model(input_ids=inputs, input_mask=torch.ones_like(inputs, dtype=torch.bool))
        loss = sharded_cross_entropy(logits, targets.transpose(0, 1).contiguous(), group=pc.tp_pg).mean()
        loss.backward()
        if pc.dp_pg.size() > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=pc.dp_pg)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if pc.dp_pg.size() > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=pc.dp_pg)
        self.post_train_step()
        return loss.item()

    def _log(self, loss: float) -> None:
        if self.wandb_run is not None:  # nanotron's row keys
            self.wandb_run.log({"lm_loss": loss, "iteration_step": self.iteration_step,
                                "consumed_tokens": self.consumed_train_samples * self.sequence_length})

    def save_checkpoint(self) -> Path:
        """nanotron's layout: <checkpoints_path>/<step>/{config.yaml, model/...} and latest.txt."""
        from nanotron.serialize import save_weights

        self.pre_save_checkpoint()
        root = Path(self.config.checkpoints.checkpoints_path)
        path = root / str(self.iteration_step)
        save_weights(model=self.unwrapped_model, parallel_context=self.parallel_context, root_folder=path)
        if dist.get_rank() == 0:
            self.config.save_as_yaml(path / "config.yaml")
            (root / "latest.txt").write_text(str(self.iteration_step))
        dist.barrier()
        self.post_save_checkpoint()
        return path

    def _batches(self):
        """Packed arithmetic text, [micro_batch, seq + 1]; each DP rank its own stream, TP ranks the same one."""
        rng = random.Random(self.config.general.seed + 1000 * dist.get_rank(self.parallel_context.dp_pg))
        eos = self.tokenizer.eos_token_id
        buffer: list[int] = []
        need = self.micro_batch_size * (self.sequence_length + 1)
        while True:
            while len(buffer) < need:
                buffer += self.tokenizer.encode(arithmetic_line(rng.randrange(10), rng.randrange(10))) + [eos]
            chunk, buffer = buffer[:need], buffer[need:]
            yield torch.tensor(chunk, dtype=torch.int64).view(self.micro_batch_size, self.sequence_length + 1)


def _plain_config():
    from nanotron.config import Config

    return Config


def _toy_fields(model_config) -> dict:
    """The ToyConfig fields from nanotron's LlamaConfig (a dataclass) or a plain dict."""
    values = model_config if isinstance(model_config, dict) else vars(model_config)
    names = {f for f in ToyConfig.__dataclass_fields__ if f != "position_ids_input"}
    return {k: values[k] for k in names if k in values}  # nanotron 0.4's LlamaConfig has no rope_theta
