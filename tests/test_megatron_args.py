"""`--backend megatron` builds the model Megatron-LM built from a checkpoint's training arguments.

One spawned rank (tests/megatron_args_worker.py) builds, for each variant of Megatron-LM's own default arguments,
the GPTModel Megatron-LM builds (its `core_transformer_config_from_args` rules restated in the test), saves it as
torch_dist (one also legacy), loads it with nano_eval's loader and compares the logits: every argument that changes
the math is applied (same logits) or refused by name. The same rank checks that the MoE dropless switch and the
KV-cache decoder fail closed. The defaults come from upstream's arguments.py
(tests/megatron_lm_defaults.json, written by scripts/megatron_lm_defaults.py; no network here).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.dist_utils import run_distributed  # noqa: E402

DEFAULTS_JSON = Path(__file__).resolve().parent / "megatron_lm_defaults.json"
TOLERANCE = 2e-5  # fp32; the zero-centred norms add 1 in another order than the live model


@pytest.fixture(scope="module")
def world(toy_checkpoint, tmp_path_factory):
    from tests import megatron_args_worker as worker

    return run_distributed(worker.all_checks, 1, str(toy_checkpoint), str(tmp_path_factory.mktemp("args")),
                           timeout=900)[0]


@pytest.fixture(scope="module")
def variants(world):
    return world["variants"]


def _cases():
    from tests.megatron_args_worker import VARIANTS

    return list(VARIANTS)


@pytest.mark.parametrize("name", _cases())
def test_each_argument_scores_like_the_live_model_or_is_refused_by_name(variants, name):
    from tests.megatron_args_worker import LEGACY, VARIANTS

    expected = VARIANTS[name][2]
    got = variants[name]
    if expected == "same":
        assert "refused" not in got and "error" not in got, got
        assert got["dist_max_diff"] <= TOLERANCE * max(1.0, got["logit_scale"]), got
        if name in LEGACY:
            assert got["legacy_max_diff"] <= TOLERANCE * max(1.0, got["logit_scale"]), got
    else:
        message = got.get("refused", "")
        assert f"argument {expected}=" in message and "Fix:" in message and "\n" not in message, got


@pytest.mark.parametrize("release", ["core_v0.16.1", "core_v0.19.0"])
def test_the_loaders_defaults_are_megatron_lms(release):
    """A missing argument means Megatron-LM's default: nano_eval's table agrees with upstream's arguments.py of
    core 0.16.1 and of core 0.19 (whose names it has: 0.19 dropped --use-legacy-models and added --use-mup and the
    other names DEFAULTS lists as 0.19's)."""
    from nano_eval.checkpoints.megatron_config import DEFAULTS

    tables = json.loads(DEFAULTS_JSON.read_text())
    upstream = tables[release]["defaults"]
    shared = sorted(set(DEFAULTS) & set(upstream))
    assert {k: DEFAULTS[k] for k in shared} == {k: upstream[k] for k in shared}
    everywhere = set().union(*(t["defaults"] for t in tables.values()))
    assert not set(DEFAULTS) - everywhere - {"heterogeneous_layers_config_path"}  # that one: core 0.15 only
    assert len(shared) >= len(DEFAULTS) - 5, sorted(set(DEFAULTS) - set(upstream))


def test_the_core_019_table_is_the_installed_wheels():
    """megatron-core 0.19.2 has no tag of its own; its wheel ships Megatron-LM's megatron/training. Where that wheel
    is installed (CI's .venv-mc19), its arguments.py and config classes give exactly the table's core_v0.19.0
    defaults (scripts/megatron_lm_defaults.py's parser on the installed files)."""
    import importlib.util

    from nano_eval.compat.megatron import megatron_core_version
    from tests.script_loader import load_script

    root = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0]).parent.parent
    if megatron_core_version()[:2] != (0, 19) or not (root / "megatron" / "training" / "arguments.py").is_file():
        pytest.skip(f"megatron-core {'.'.join(map(str, megatron_core_version()))} is installed, not a 0.19 wheel "
                    "with megatron/training (CI's .venv-mc19 has one)")
    script = load_script("scripts/megatron_lm_defaults.py", "megatron_lm_defaults")
    _, installed = script.model_math_defaults(lambda path: (root / path).read_text())
    assert installed == json.loads(DEFAULTS_JSON.read_text())["core_v0.19.0"]["defaults"]


def test_every_model_math_argument_has_a_rule():
    """Each argument of the defaults JSON that changes the math is read by the translation (applied, renamed,
    derived or refused); the rest are named here with the reason they change nothing at evaluation."""
    from nano_eval.checkpoints import megatron_config as mc

    no_effect = {"seq_length": "max_position_embeddings is used", "openai_gelu": "Megatron-LM's core models ignore it",
                 "add_position_embedding": "validate_args folds it into position_embedding_type",
                 "use_rotary_position_embeddings": "validate_args folds it into position_embedding_type",
                 "mrope_section": "mrope is refused", "moe_grouped_gemm": "the same weights as SequentialMLP",
                 "moe_input_jitter_eps": "off while scoring", "transformer_impl": "the same weights in either",
                 "max_position_embeddings": "GPTModel's max_sequence_length"}
    read = set(mc.DEFAULTS) | set(mc.SAME_NAME) | set(mc.RENAMED_BEFORE_0_16) | set(no_effect)
    for release in json.loads(DEFAULTS_JSON.read_text()).values():
        assert not set(release["defaults"]) - read, set(release["defaults"]) - read


def test_unsupported_arguments_are_refused_in_one_line():
    from nano_eval.checkpoints.megatron_config import UnsupportedArgument, translate
    from nano_eval.errors import NanoEvalError

    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, seq_length=64)
    for name, value in [("use_legacy_models", True), ("spec", ["my.module", "spec"]), ("yaml_cfg", "m.yaml"),
                        ("normalization", "L2Norm"), ("moe_latent_size", 16), ("is_hybrid_model", True),
                        ("heterogeneous_layers_config_path", "h.json"), ("experimental_attention_variant", "dsa"),
                        ("use_mup", True), ("moe_mlp_glu_interleave_size", 32), ("moe_router_force_biased", 0.1)]:
        with pytest.raises(UnsupportedArgument, match=f"argument {name}=.*Fix: ") as error:
            translate({**sizes, name: value})
        assert isinstance(error.value, NanoEvalError) and error.value.argument == name


def test_dropless_scoring_fails_closed(world):
    """The MoE dropless switch refuses, by name and with megatron-core's version, a model whose dispatcher lacks a
    field it must switch (removed from a real alltoall dispatcher instance), a dispatcher class it does not know, or
    a flex dispatcher's manager without its capacity field; the intact model builds."""
    from nano_eval.compat.megatron import version_string

    got = world["dropless"]
    assert got["as built"] == "built"
    for case, named in [("drop_and_pad removed", "MoEAlltoAllTokenDispatcher has no 'drop_and_pad'"),
                        ("unknown dispatcher", "RenamedTokenDispatcher is a token dispatcher nano_eval does not know"),
                        ("flex manager capacity_factor removed", "_DeepepManager has no 'capacity_factor'")]:
        assert got[case].startswith("NanoEvalError: cannot score this MoE model without token dropping"), got[case]
        assert named in got[case] and version_string() in got[case] and "Fix:" in got[case], got[case]
    # past the attribute check: the routing-map probe stops the forward as the map leaves the router, before a token
    # dispatcher gets it (0.19's alltoall dispatcher crashed on it with a split-size RuntimeError)
    dropped = got["router drops a token"]
    assert dropped.startswith("NanoEvalError: a MoE router dropped tokens while scoring (1 token-layer"), dropped


def test_the_transformers_converter_reads_the_same_names():
    """load_as_transformers' LlamaConfig: the epsilon under either release's name; zero-centred norms refused (the
    conversion copies norm weights as they are) with the backend that folds them."""
    from nano_eval.checkpoints.megatron_args import LLAMA_STYLE, hf_config_from_args
    from nano_eval.errors import NanoEvalError

    llama = dict(LLAMA_STYLE, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                 seq_length=64, untie_embeddings_and_output_weights=True)
    assert hf_config_from_args({**llama, "layernorm_epsilon": 0.25}, 128).rms_norm_eps == 0.25  # core 0.16
    assert hf_config_from_args({**llama, "norm_epsilon": 0.5}, 128).rms_norm_eps == 0.5  # up to core 0.15
    for name in ("apply_layernorm_1p", "layernorm_zero_centered_gamma"):
        with pytest.raises(NanoEvalError, match="zero-centred.*--backend megatron"):
            hf_config_from_args({**llama, name: True}, 128)


def test_kv_cache_decoding_fails_closed(world):
    """Greedy generation from megatron-core's KV cache decodes exactly (tokens equal the re-run path's) as built; a
    release whose output layer got the last column only, or whose attention stopped writing and reading the static
    cache, stops the generation with one line naming megatron-core's version instead of decoding other tokens.
    (Before the fix, megatron-core 0.19 took the first path silently: the decoder read the prompt's first column.)"""
    from nano_eval.compat.megatron import version_string

    got = world["cache_contract"]
    assert got["as built"] == "decoded", got
    for case in ("last column only", "no KV cache"):
        message = got[case]
        assert message.startswith("CacheContractError: greedy generation from megatron-core"), (case, message)
        assert version_string() in message and "Fix:" in message and "\n" not in message, (case, message)
