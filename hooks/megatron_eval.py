"""Drop-in for Megatron-LM's `pretrain`: evaluate the live model at every validation, in its TP/PP/DP layout.

    from nano_eval.training.megatron import make_non_loss_data_func   # (re-exported here)

    hook = make_non_loss_data_func(EvalHookConfig(tasks="lighteval|hellaswag|0", max_samples=500,
                                                  output_dir="eval", wandb_project="my-run"), tokenizer)
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             non_loss_data_func=hook)
    hook.close()

Why `non_loss_data_func` (called on every rank) and not `process_non_loss_data_func` (last rank only, which
would hang a TP/PP model): see nano_eval/training/megatron.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # usable from a checkout without installing

from nano_eval.training.megatron import MegatronEvalHook, consumed_tokens, make_non_loss_data_func  # noqa: E402,F401

__all__ = ["MegatronEvalHook", "consumed_tokens", "make_non_loss_data_func"]
