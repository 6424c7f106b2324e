"""Evaluation inside training: the hook, its config, and the nanotron trainer / Megatron pretrain adapters."""
