"""Result files, W&B and reports."""
