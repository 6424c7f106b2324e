"""What every checkpoint converter shares: a transformers Llama from a converted state dict, and the one rotary
permutation (interleaved pairs -> rotate-half)."""

from __future__ import annotations

import math

import torch

from nano_eval.checkpoints.untrusted import FilePolicy
from nano_eval.errors import NanoEvalError


def llama_from_state_dict(config, state: dict[str, torch.Tensor], where: str, policy: FilePolicy = FilePolicy(),
                          model_class=None):
    """LlamaForCausalLM(config) (or `model_class`, a Llama-shaped transformers class such as SmolLM3ForCausalLM)
    holding `state` exactly: every weight present (lm_head may be the tied embedding), nothing left over, every
    shape as the config says; otherwise a NanoEvalError naming `where` and what does not fit. The shapes are
    compared on a meta-device model first, so a config that declares a larger model than its weights is refused
    before anything is allocated."""
    from transformers import LlamaForCausalLM

    check_config_values(config, where)
    cls = model_class or LlamaForCausalLM

    check_module_counts(config, sum(t.numel() * t.element_size() for t in state.values()), where)
    try:
        with torch.device("meta"):
            expected = {k: v.shape for k, v in cls(config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError, OverflowError, AttributeError) as e:
        raise NanoEvalError(f"{where}: its configuration describes no Llama transformers can build "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}). Fix: restore the configuration "
                            "from the run that saved the checkpoint.") from e
    missing = [k for k in expected if k not in state and not (config.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} (config: {tuple(v)})" for k, v in expected.items()
             if k in state and state[k].shape != v]
    if missing or unexpected or wrong:
        raise NanoEvalError(f"{where}: weights do not fit a Llama (missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}, wrong shapes {wrong[:3]}). Fix: check that the checkpoint's "
                            "configuration matches its weights (copy it again if it was edited).")
    policy.check_allocation(sum(v.numel() for v in expected.values()) * 4, where, "the model")
    model = cls(config)
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def interleaved_to_half_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows from interleaved-pair rotary order to transformers' rotate-half order.

    Interleaved rotary (nanotron's training convention, flash-attn `interleaved=True`, Megatron's
    `rotary_interleaved=True`) rotates pairs (x[2i], x[2i+1]); transformers' Llama rotates halves (x[i], x[i + d/2]).
    Per head, rows [r0, r1, r2, r3, ...] become [r0, r2, ..., r1, r3, ...]. w: [heads * head_dim, in_features]."""
    d = w.shape[0] // heads
    return w.view(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


# config attribute names (transformers' families) of the layer count, the hidden width and the experts per layer
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_WIDTH = ("hidden_size", "n_embd", "d_model")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _count(config, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# config values a model divides by, takes a power or a root of: (names, what a working model needs, the rule)
_POSITIVE = ("rope_theta", "factor")  # rotary base, and a rope scaling factor: 1 / theta ** (2i / d), pos / factor
_NOT_NEGATIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def check_config_values(config, where: str) -> None:
    """Refuse, naming the field, a config value that can only give NaN or inf logits: a rotary base or rope scaling
    factor that is not a finite number > 0 (`rope_theta: 0` gives infinite rotary frequencies and NaN everywhere),
    a norm epsilon that is negative or not finite. Looks at the config, its text_config, and their rope parameters
    (transformers 5 keeps rope_theta there, per layer type in some models). Scores that turn out non-finite
    anyway (NaN weights) are caught when scored (nano_eval.finite)."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        values = [(name, getattr(cfg, name, None)) for name in ("rope_theta", *_NOT_NEGATIVE)]
        for rope in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
            if isinstance(rope, dict):
                nested = [r for r in rope.values() if isinstance(r, dict)]  # per layer type
                for r in [rope, *nested]:
                    values += [(f"rope_parameters.{name}" if name != "rope_theta" else name, r.get(name))
                               for name in _POSITIVE]
        for name, value in values:
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            bad = (not math.isfinite(value) or value <= 0) if name.endswith(_POSITIVE) else \
                (not math.isfinite(value) or value < 0)
            if bad:
                need = "a finite number > 0" if name.endswith(_POSITIVE) else "a finite number >= 0"
                raise NanoEvalError(f"{where}: its configuration's {name} is {value}, but it must be {need} (with "
                                    "this value the model gives NaN or meaningless logits). Fix: restore "
                                    f"{name} to the value the model was trained with (the training run's config).")


def check_module_counts(config, weight_bytes: int, where: str) -> None:
    """Refuse, by arithmetic and before any model is built, a config with no layers, or whose layers (times experts)
    cannot fit in `weight_bytes`: every layer, and every expert in it, holds at least `hidden_size` parameters (a
    norm, a projection row), each at least one byte on disk. Even a meta-device model costs time and memory per module:
    `num_hidden_layers: 2147483648` in config.json used to keep the loader building modules for minutes."""
    for cfg in (config, getattr(config, "text_config", None)):
        layers = _count(cfg, _LAYERS) if cfg is not None else None
        if layers is None:
            continue
        if layers <= 0:
            raise NanoEvalError(f"{where}: its configuration declares {layers} layers. Fix: restore the "
                                "configuration that matches the weights, or copy the checkpoint again.")
        width, experts = max(1, _count(cfg, _WIDTH) or 1), max(1, _count(cfg, _EXPERTS) or 1)
        if layers * experts * width > weight_bytes + (1 << 20):
            per_layer = f" x {experts:,} experts" if experts > 1 else ""
            raise NanoEvalError(f"{where}: its configuration declares {layers:,} layers{per_layer} of width "
                                f"{width:,}, more than its weight files' {weight_bytes:,} bytes can hold. Fix: "
                                "restore the configuration that matches the weights, or copy the checkpoint again.")


def check_config_size(config, weight_bytes: int, where: str, policy: FilePolicy = FilePolicy()) -> int:
    """Refuse a model config that declares more parameters than its weight files have bytes (a parameter takes at
    least one byte on disk; tied embeddings counted once), or more than the allocation limit. The layer count is
    bounded first (check_module_counts), then the parameters are counted on a meta-device model: nothing is
    allocated. Returns the count."""
    from transformers import AutoModelForCausalLM

    check_config_values(config, where)
    check_module_counts(config, weight_bytes, where)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (RuntimeError, ValueError, TypeError, OverflowError, AttributeError, KeyError) as e:
        raise NanoEvalError(f"{where}: its configuration describes no model transformers can build "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}). Fix: restore the configuration "
                            "from the run that saved the checkpoint.") from e
    params = sum(p.numel() for p in model.parameters())
    if params > weight_bytes + (1 << 20):
        raise NanoEvalError(f"{where}: its configuration declares {params:,} parameters but its weight files hold "
                            f"only {weight_bytes:,} bytes. Fix: restore the configuration that matches the weights, "
                            "or copy the checkpoint again.")
    policy.check_allocation(params * 4, where, f"a model of {params:,} parameters")
    return params
