"""Runs inside each spawned rank of tests/test_nanotron_trainer.py."""


def train(rank, world, config_path, wandb_dir):
    """Train the CPU stand-in trainer with the nano_eval mixin from `config_path`; losses and evaluated steps."""
    import os

    import torch

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true", WANDB_DIR=wandb_dir)
    torch.set_num_threads(1)
    from nano_eval.training.nanotron import NanoEvalTrainerMixin, config_class
    from tests.toy_nanotron_trainer import ToyNanotronTrainer

    trainer_cls = type("ToyEvaluatingTrainer", (NanoEvalTrainerMixin, ToyNanotronTrainer), {})
    trainer = trainer_cls(config_path, config_class=config_class())
    losses = trainer.train()
    hook = trainer.nano_eval_hook
    return {"losses": losses, "evaluated": hook.evaluated_steps if hook else None,
            "publisher": hook.is_publisher if hook else None}
