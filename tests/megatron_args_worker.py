"""Code that runs inside the spawned rank of tests/test_megatron_args.py: for each variant of Megatron-LM's training
arguments, the GPTModel Megatron-LM builds from them (live), saved as Megatron-LM saves it, then loaded by
`--backend megatron` (nano_eval.checkpoints.megatron_native.load_native) and compared logit for logit.

The args are Megatron-LM's own defaults (tests/megatron_lm_defaults.json, read from upstream's arguments.py by
scripts/megatron_lm_defaults.py) with a tiny model's sizes, what `validate_args` derives, and the variant's
arguments on top. The live model is built by `megatron_lm_config` below: Megatron-LM's
`core_transformer_config_from_args` rules restated for the test (every TransformerConfig field of the same name,
then the renames and derived fields of that release), independent of nano_eval's translation. Its norms are
`ZeroCenteredNorm`, a stand-in for Transformer Engine's / Apex's norms, which compute norm(x) * (1 + w) under
`--apply-layernorm-1p` (megatron-core's torch norms refuse that setting: a CUDA-kernel test double).
"""

from __future__ import annotations

import hashlib
import json
import time
from argparse import Namespace
from pathlib import Path

import torch

DEFAULTS = Path(__file__).resolve().parent / "megatron_lm_defaults.json"
NEW, OLD, NEWEST = "core_v0.16.1", "core_v0.15.3", "core_v0.19.0"  # 0.19.2 ships core_v0.19.0's arguments.py
SIZES = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, max_position_embeddings=64,
             seq_length=64, padded_vocab_size=128)
MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall")
ROPE = dict(position_embedding_type="rope")
# name: (release whose defaults and names the args use, the arguments set, expected: "same" or the refused name)
VARIANTS = {
    "defaults (LayerNorm, GELU, biases, learned positions, tied)": (NEW, {}, "same"),
    "core 0.19 defaults": (NEWEST, {}, "same"),
    "Llama with core 0.19 defaults: rope, swiglu, GQA, RMSNorm, no biases, untied": (NEWEST, dict(
        ROPE, swiglu=True, group_query_attention=True, num_query_groups=2, normalization="RMSNorm",
        add_bias_linear=False, untie_embeddings_and_output_weights=True), "same"),
    "--apply-layernorm-1p --norm-epsilon (core 0.15 names)": (OLD, dict(apply_layernorm_1p=True, norm_epsilon=0.5),
                                                               "same"),
    "--apply-layernorm-1p --norm-epsilon (core 0.16 names), RMSNorm": (
        NEW, dict(layernorm_zero_centered_gamma=True, layernorm_epsilon=0.5, normalization="RMSNorm"), "same"),
    "Llama: rope base and percent, swiglu, GQA, RMSNorm, no biases, untied, qk-layernorm": (NEW, dict(
        ROPE, rotary_base=500, rotary_percent=0.5, swiglu=True, group_query_attention=True, num_query_groups=2,
        normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True),
        "same"),
    "squared-relu, QKV bias only, interleaved rope": (NEW, dict(
        ROPE, squared_relu=True, add_bias_linear=False, add_qkv_bias=True, rotary_interleaved=True), "same"),
    "quick-geglu, kv-channels": (NEW, dict(quick_geglu=True, kv_channels=8), "same"),
    "llama3 rope scaling": (NEW, dict(ROPE, use_rope_scaling=True, rotary_base=50), "same"),
    "no position embedding": (NEW, dict(position_embedding_type="none"), "same"),
    "num-query-groups without --group-query-attention": (NEW, dict(num_query_groups=2), "same"),
    "MoE: top-1 sigmoid, expert bias, shared expert with gate, layer freq, moe-ffn": (NEW, dict(
        **MOE, **ROPE, normalization="RMSNorm", swiglu=True, add_bias_linear=False, moe_router_topk=1,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True, moe_layer_freq=[0, 1],
        moe_router_load_balancing_type="none"), "same"),
    "MoE: pre-softmax top-2, scaling factor, group-limited routing": (NEW, dict(
        **MOE, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_router_load_balancing_type="none"), "same"),
    "qk-l2-norm (rope)": (NEW, dict(ROPE, qk_l2_norm=True), "same"),
    "attention output gate, off-by-one softmax": (NEW, dict(attention_output_gate=True, softmax_type="off-by-one"),
                                                  "same"),
    "window attention every other layer, query-key layer scaling, no rope on layer 2": (NEW, dict(
        ROPE, window_size=(6, 0), window_attn_skip_freq=2, apply_query_key_layer_scaling=True, no_rope_freq=[0, 1]),
        "same"),
    "swiglu with glu-linear-offset and activation clamp, fp32 residual": (NEW, dict(
        swiglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5, fp32_residual_connection=True), "same"),
    "MoE: top-1, probs on input, fp32 router": (NEW, dict(
        **MOE, moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none"), "same"),
    "rope interpolation factor": (NEW, dict(ROPE, rotary_seq_len_interpolation_factor=2),
                                  "rotary_seq_len_interpolation_factor"),
    "rope scaling factor 16": (NEW, dict(ROPE, use_rope_scaling=True, rope_scaling_factor=16.0),
                               "rope_scaling_factor"),
    "multi-latent attention": (NEW, dict(ROPE, multi_latent_attention=True), "multi_latent_attention"),
    "yarn": (NEW, dict(position_embedding_type="yarn"), "position_embedding_type"),
    "maximal-update parameterisation (core 0.19)": (NEWEST, dict(use_mup=True), "use_mup"),
    "random router bias (core 0.19)": (NEWEST, dict(**MOE, moe_router_force_biased=0.1,
                                                    moe_router_load_balancing_type="none"), "moe_router_force_biased"),
}
LEGACY = ("--apply-layernorm-1p --norm-epsilon (core 0.15 names)",)  # also saved in the legacy format
ITERATION = 7


def megatron_lm_args(release: str, **arguments) -> Namespace:
    """Megatron-LM's parsed arguments (its defaults of `release`, the tiny sizes, `arguments`) after the parts of
    its validate_args that derive model fields."""
    args = dict(json.loads(DEFAULTS.read_text())[release]["defaults"])
    args.update(SIZES, **arguments)
    args.update(params_dtype=torch.float32, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=1, ckpt_format="torch_dist", transformer_impl="local")
    if args["kv_channels"] is None:
        args["kv_channels"] = args["hidden_size"] // args["num_attention_heads"]
    if args["add_bias_linear"]:
        args["add_qkv_bias"] = True
    if args["num_experts"] is not None and args["moe_ffn_hidden_size"] is None:
        args["moe_ffn_hidden_size"] = args["ffn_hidden_size"]
    return Namespace(**args)


def megatron_lm_config(args: Namespace, release: str):
    """Megatron-LM's TransformerConfig of `args` (core_transformer_config_from_args' rules), set for evaluation."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    if release == OLD:
        kw["layernorm_zero_centered_gamma"], kw["layernorm_epsilon"] = args.apply_layernorm_1p, args.norm_epsilon
    kw["num_moe_experts"] = args.num_experts
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if args.squared_relu:
        kw["activation_func"] = squared_relu
    elif args.quick_geglu:
        kw.update(activation_func=quick_gelu, gated_linear_unit=True)
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    kw.update(hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
              masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, moe_grouped_gemm=False, moe_permute_fusion=False,
              use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    return TransformerConfig(**kw)


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm / RMSNorm as Transformer Engine computes it: weight (and LayerNorm's bias); under
    `layernorm_zero_centered_gamma`, norm(x) * (1 + weight)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.rms, self.eps = config.normalization == "RMSNorm", eps
        self.centered = config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if self.centered else torch.ones(hidden_size))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        weight = self.weight + 1 if self.centered else self.weight
        if self.rms:
            return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, self.eps)
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, self.bias, self.eps)


def _with_norm(spec):
    """The layer / block spec with every megatron torch norm (WrappedTorchNorm) replaced by ZeroCenteredNorm."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return ZeroCenteredNorm
    if isinstance(spec, list):
        return [_with_norm(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _with_norm(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def live_model(args: Namespace, release: str):
    """The GPTModel Megatron-LM's gpt_builder builds from `args` (local spec), holding seeded random weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    model_parallel_cuda_manual_seed(1234)
    config = megatron_lm_config(args, release)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm)
    else:
        layer = get_gpt_layer_local_spec(None, False, args.qk_layernorm, normalization=args.normalization,
                                         qk_l2_norm=args.qk_l2_norm)
        spec = TransformerBlockSubmodules(layer_specs=[layer] * args.num_layers, layer_norm=ZeroCenteredNorm)
    model = GPTModel(config=config, transformer_layer_spec=_with_norm(spec), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                     parallel_output=True,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not name.endswith("inv_freq"):
                tensor.copy_(_seeded(tensor.shape, name) * _scale(name, config.layernorm_zero_centered_gamma)
                             + (1.0 if "layernorm.weight" in name and not config.layernorm_zero_centered_gamma
                                else 0.0))
    return model.eval()


def _scale(name: str, centered: bool) -> float:
    if "layernorm" in name:
        return 0.3 if centered else 0.1
    return {"word_embeddings": 1.0, "position_embeddings": 0.5, "expert_bias": 0.5, "router": 0.5}.get(
        next((k for k in ("word_embeddings", "position_embeddings", "expert_bias", "router") if k in name), ""), 0.2)


def _seeded(shape, name: str) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(digest))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from nano_eval.backends.megatron import MegatronModel

    with torch.no_grad():
        return model(*MegatronModel._inputs(ids))


def variants(rank, world, tokenizer_dir, root, names=None) -> dict:
    """{variant: {"max_diff": live vs loaded logits, "legacy_max_diff": ..., or "refused": message}}."""
    from tests.megatron_worker import _setup, save_dist_checkpoint, save_legacy_checkpoint

    from nano_eval.checkpoints.megatron_native import load_native
    from nano_eval.errors import NanoEvalError

    root = Path(root)
    ids = torch.randint(0, SIZES["padded_vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    for i, name in enumerate(names or VARIANTS):
        start = time.monotonic()
        release, arguments, _ = VARIANTS[name]
        _setup(1)
        args = megatron_lm_args(release, **arguments)
        result = {}
        try:
            model = live_model(args, release)
        except Exception as e:  # noqa: BLE001 -- what megatron-core cannot build (MLA without TE, yarn ...)
            model, result["live"] = None, f"{type(e).__name__}: {e}"[:200]
        if model is not None:
            live = _logits(model, ids)
            save_dist_checkpoint(model, args, root / f"v{i}", ITERATION)
            if name in LEGACY:
                save_legacy_checkpoint(model, Namespace(**{**vars(args), "ckpt_format": "torch"}), root / f"l{i}",
                                       ITERATION)
        else:  # save the args alone: the loader must refuse before it reads any weight
            live = None
            _save_args_only(args, root / f"v{i}")
        for kind in ("dist", "legacy") if name in LEGACY else ("dist",):
            path = root / (f"v{i}" if kind == "dist" else f"l{i}")
            try:
                backend = load_native(str(path), str(tokenizer_dir), tp=1, pp=1, ep=1, dtype="float32",
                                      max_length=None, device="cpu")
                loaded = _logits(backend.chunks[0], ids)
                result[f"{kind}_max_diff"] = (loaded - live).abs().max().item()
                result["logit_scale"] = live.abs().max().item()
            except NanoEvalError as e:
                result["refused"] = str(e)
            except Exception as e:  # noqa: BLE001 -- reported: the test expects none
                result["error"] = f"{type(e).__name__}: {e}"[:300]
        out[name] = {**result, "seconds": round(time.monotonic() - start, 1)}
    return out


def _save_args_only(args: Namespace, root: Path) -> None:
    """A legacy checkpoint holding the args and no weights (for arguments megatron-core cannot build here)."""
    path = root / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": {}}, path)
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def dropless_checks(tokenizer_dir) -> dict:
    """A real MoE model trained with token dropping (alltoall dispatcher, capacity 1.0, padded to capacity): the
    backend builds on it as is; with a field the dropless switch needs removed from a real dispatcher instance
    (what a rename in a megatron-core upgrade looks like), or with a dispatcher class nano_eval does not know, the
    backend is refused; and a router that drops a token anyway stops the forward: {case: "built" (and scored) or
    the error message}."""
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from tests.megatron_moe import build_moe_model
    from tests.megatron_worker import _setup

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = {}
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.tensor([0, 1]), torch.tensor([11, 11])
    for case in ("as built", "drop_and_pad removed", "unknown dispatcher", "flex manager capacity_factor removed",
                 "router drops a token"):
        _setup(1)
        model = build_moe_model(capacity=1.0, pad_to_capacity=True).eval()
        dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
        if case == "drop_and_pad removed":
            del dispatchers[-1].drop_and_pad
        elif case == "unknown dispatcher":
            dispatchers[0].__class__ = type("RenamedTokenDispatcher", (type(dispatchers[0]),), {})
        elif case == "flex manager capacity_factor removed":  # a flex dispatcher's manager, minus the field
            manager = type("_DeepepManager", (), {})()
            dispatchers[0]._comm_manager = manager
            dispatchers[0].__class__ = type("MoEFlexTokenDispatcher", (type(dispatchers[0]),), {})
        elif case == "router drops a token":  # a capacity the dropless switch missed: the last token loses its experts
            router = next(m for m in model.modules() if hasattr(m, "routing") and hasattr(m, "topk"))
            routing = router.routing

            def dropping(logits, **kwargs):
                probs, routing_map = routing(logits, **kwargs)
                routing_map = routing_map.clone()
                routing_map[-1] = False
                return probs * routing_map, routing_map

            router.routing = dropping
        try:
            backend = MegatronModel(model, tok, max_length=64)
            backend.run(MegatronModel._inputs(ids), rows, cols)
            out[case] = "built"
        except Exception as e:  # noqa: BLE001 -- the message is the result
            out[case] = f"{type(e).__name__}: {e}"
    return out


def cache_contract_checks(tokenizer_dir) -> dict:
    """The KV-cache decoder on megatron-core's GPTModel (tp1) as built, and with the release's behaviour moved the
    two ways a decoder could go silently wrong: the output layer handed the last column only (what megatron-core's
    switch does where it is obeyed: always up to 0.17, under its InferenceMode from 0.18), and attention no longer
    writing and reading the static KV cache. {case: "decoded" (cached tokens == re-run tokens) or the error}."""
    from megatron.core.transformer.attention import Attention
    from transformers import AutoTokenizer

    from nano_eval.backends.base import evaluation_mode
    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.backends.megatron_cache import StaticCache
    from nano_eval.compat.megatron import release
    from tests.generation_checks import Rerunning, generate
    from tests.megatron_gpt import GPTConfig, build_gpt_chunks
    from tests.megatron_worker import _setup

    out = {}
    for case in ("as built", "last column only", "no KV cache"):
        _setup(1)
        backend = MegatronModel(build_gpt_chunks(), AutoTokenizer.from_pretrained(tokenizer_dir),
                                max_length=GPTConfig().max_position_embeddings)
        allocate, adjust, mode = StaticCache.allocate, Attention._adjust_key_value_for_inference, None
        if case == "last column only":
            def last_column_only(self, rows, columns):
                allocate(self, rows, columns)
                owner = self.context.config if hasattr(self.context, "config") else self.context
                owner.materialize_only_last_token_logits = True

            StaticCache.allocate = last_column_only
            if release().inference_mode_flag:
                from megatron.core.inference.utils import InferenceMode as mode

                mode.set_active()
        elif case == "no KV cache":  # the attention of a model called without a context: this call's columns only
            def no_cache(self, context, q, k, v, rotary, *rest, **kw):
                rotary = None if rotary is None else tuple(r[:q.shape[0]] for r in rotary)
                return q, k, v, rotary, self.attn_mask_type, None

            Attention._adjust_key_value_for_inference = no_cache
        try:
            with evaluation_mode(backend.module):
                cached, rerun = generate(backend, []), generate(Rerunning(backend), [])
            out[case] = "decoded" if cached == rerun else "decoded differently"
        except Exception as e:  # noqa: BLE001 -- the message is the result
            out[case] = f"{type(e).__name__}: {e}"
        finally:
            StaticCache.allocate, Attention._adjust_key_value_for_inference = allocate, adjust
            if mode is not None:
                mode.unset_active()
    return out


def all_checks(rank, world, tokenizer_dir, root) -> dict:
    """The one spawned rank of tests/test_megatron_args.py: the argument variants, then the dropless checks and the
    KV cache's contract checks."""
    start = time.monotonic()
    out = {"variants": variants(rank, world, tokenizer_dir, root)}
    out["dropless"] = dropless_checks(tokenizer_dir)
    out["cache_contract"] = cache_contract_checks(tokenizer_dir)
    out["seconds"] = round(time.monotonic() - start, 1)
    return out
