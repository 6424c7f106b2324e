"""Glue between nano_eval and training frameworks (nanotron trainer mixin, ...)."""
