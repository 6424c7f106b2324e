"""nanotron's `run_train.py` with evaluation: train from a nanotron YAML and score the live model as it trains.

    torchrun --nproc_per_node=8 hooks/nanotron_eval.py --config-file examples/nanotron_eval.yaml

The YAML is a normal nanotron config (0.4, or main's with `data_stages:`) plus a `nano_eval:` section (annotated
in examples/nanotron_eval.yaml): tasks, interval, on_save, max_samples, time_budget_s, batch_tokens, output_dir,
W&B options, fail_soft. The trainer is nanotron's DistributedTrainer with `NanoEvalTrainerMixin`
(nano_eval/training/nanotron.py), which builds the evaluation once in `post_init` and runs it from
`post_train_step` / `post_save_checkpoint` on every rank, in the model's own TP/PP/DP layout. Needs what nanotron's
trainer needs: CUDA and flash-attn (the test suite runs it on CPU with test doubles that live in tests/: nanotron
0.4 through tests/nanotron_cpu_launch.py, nanotron main through tests/nanotron_main_launch.py).
To add evaluation to your own launcher instead, replace `DistributedTrainer` by `trainer_class()` and read the
config with `load_config` (nanotron's parser rejects the unknown `nano_eval:` key otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nano_eval.training.nanotron import config_class, trainer_class  # noqa: E402


def get_dataloader(trainer):
    """The training data, as nanotron's run_train.py builds it: dummy tokens, or (nanotron 0.4) an HF dataset
    (tokenised and grouped into sequence_length + 1 chunks)."""
    if hasattr(trainer.config, "data_stages"):
        return _main_dummy_data(trainer)
    from nanotron.dataloader import clm_process, dummy_infinite_data_generator, get_datasets, get_train_dataloader
    from nanotron.parallel.pipeline_parallel.utils import get_input_output_pp_ranks
    from transformers import AutoTokenizer

    cfg = trainer.config
    input_pp_rank, output_pp_rank = get_input_output_pp_ranks(model=trainer.model)
    if cfg.data.dataset is None:
        return dummy_infinite_data_generator(
            micro_batch_size=trainer.micro_batch_size, sequence_length=trainer.sequence_length,
            input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank,
            vocab_size=trainer.model_config.vocab_size, seed=cfg.data.seed, parallel_context=trainer.parallel_context,
        )()
    ds = cfg.data.dataset
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer.tokenizer_name_or_path,
                                              revision=cfg.tokenizer.tokenizer_revision)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    raw = get_datasets(hf_dataset_or_datasets=ds.hf_dataset_or_datasets, splits=ds.hf_dataset_splits)["train"]
    train = clm_process(raw_dataset=raw, tokenizer=tokenizer, text_column_name=ds.text_column_name,
                        dataset_processing_num_proc_per_process=ds.dataset_processing_num_proc_per_process,
                        dataset_overwrite_cache=ds.dataset_overwrite_cache, sequence_length=trainer.sequence_length)
    return get_train_dataloader(
        train_dataset=train, sequence_length=trainer.sequence_length, parallel_context=trainer.parallel_context,
        input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank, micro_batch_size=trainer.micro_batch_size,
        consumed_train_samples=trainer.consumed_train_samples, dataloader_num_workers=cfg.data.num_loading_workers,
        seed_worker=cfg.data.seed, dataloader_drop_last=True,
    )


def _main_dummy_data(trainer):
    """nanotron main (`data_stages:`): its dummy data (packed documents for Qwen2), keyed by the stage's name as
    main's trainer wants it.
    Real datasets go through nanotron main's own run_train.py with `trainer_class()` (see the module docstring)."""
    from nanotron.config import Qwen2Config
    from nanotron.data.dataloader import dummy_infinite_data_generator
    from nanotron.parallel.pipeline_parallel.utils import get_input_output_pp_ranks

    from nano_eval.errors import NanoEvalError

    stages = trainer.config.data_stages
    if len(stages) != 1 or stages[0].data.dataset is not None:
        raise NanoEvalError(f"{sys.argv[0]} runs nanotron main on its dummy data only (one data stage, `dataset: "
                            "null`). Fix: train with nanotron's own run_train.py, its DistributedTrainer replaced by "
                            "nano_eval.training.nanotron.trainer_class() and config_class=config_class()")
    input_pp_rank, output_pp_rank = get_input_output_pp_ranks(model=trainer.model)
    data = dummy_infinite_data_generator(
        micro_batch_size=trainer.micro_batch_size, sequence_length=trainer.sequence_length,
        input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank, vocab_size=trainer.model_config.vocab_size,
        seed=stages[0].data.seed, parallel_context=trainer.parallel_context,
        use_position_ids=isinstance(trainer.model_config, Qwen2Config), cp_pg=trainer.parallel_context.cp_pg,
    )()
    return {stages[0].name: data}  # main's trainer takes one data loader per stage name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-file", required=True, help="nanotron YAML with a `nano_eval:` section")
    args = p.parse_args(argv)
    trainer = trainer_class()(args.config_file, config_class=config_class())
    trainer.train(get_dataloader(trainer))


if __name__ == "__main__":
    main()
