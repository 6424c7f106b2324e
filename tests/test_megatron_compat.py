"""nano_eval.compat.megatron: the row of RELEASES for the installed megatron-core says what that release really does
(checked against its code here, on 0.16.1 in the main environment and on 0.19.2 in CI's .venv-mc19), and a release
outside the tested range is named in one line, its KV cache left unused where its minor release is not in the table.
"""

import inspect

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from nano_eval.compat import megatron as compat  # noqa: E402


@pytest.fixture(scope="module")
def row():
    found = compat.release()
    assert found is not None, f"megatron-core {compat.version_string()} has no row in RELEASES"
    return found


def test_the_installed_release_is_a_tested_one():
    assert compat.megatron_core_version() in compat.TESTED, compat.version_string()
    assert compat.release_warning() is None


def test_the_row_says_where_the_last_column_switch_lives(row):
    from megatron.core.inference.contexts import StaticInferenceContext

    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=4)
    owner = context.config if row.last_token_switch == "context.config" else context
    assert owner.materialize_only_last_token_logits is True  # megatron-core's default: the last column only
    assert compat.static_inference_context(2, 4) is not None
    built = compat.static_inference_context(2, 4)
    assert (built.config if row.last_token_switch == "context.config" else built).materialize_only_last_token_logits \
        is False


def test_the_row_says_whether_gptmodel_obeys_the_switch_only_under_inference_mode(row):
    from megatron.core.models.gpt import gpt_model

    assert ("InferenceMode.is_active()" in inspect.getsource(gpt_model)) == row.inference_mode_flag
    assert not compat.inference_mode_active()


def test_the_row_says_how_load_reads_the_common_state(row):
    from megatron.core.dist_checkpointing import serialization

    takes_strategy = "common_strategy" in inspect.signature(serialization.load).parameters
    load_source = inspect.getsource(serialization.load)
    if row.common_loader == "common_strategy":
        assert takes_strategy and "common_strategy.load_common(" in load_source
    else:
        assert f"{row.common_loader}(checkpoint_dir)" in load_source
    assert ("common_state" in inspect.getsource(serialization.save)) == (row.common_state == "common_state")


def test_the_row_names_the_experts_classes_and_dropless_fields(row):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts, token_dispatcher

    assert {name for name in row.experts if hasattr(experts, name)} == set(row.experts)
    assert not hasattr(experts, "GroupedMLP") or "GroupedMLP" in row.experts
    fields = {f.name for f in __import__("dataclasses").fields(TransformerConfig)}
    assert {name for name, _ in row.dropless_config} <= fields
    for name, _ in row.dispatcher_fields:
        assert hasattr(token_dispatcher, name), name


def test_a_release_outside_the_tested_range_says_so_in_one_line():
    for version in ((0, 16, 0), (0, 19, 3), (0, 20, 0)):
        line = compat.release_warning(version)
        assert line.startswith("nano_eval: warning: megatron-core ") and "\n" not in line, line
        assert "0.16.1 to 0.19.2" in line
    assert "re-runs the prompt" in compat.release_warning((0, 20, 0))
    for version in ((0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 2)):
        assert compat.release_warning(version) is None


def test_an_unknown_minor_release_decodes_by_re_running(monkeypatch):
    """No row for 0.20: no KV cache (the context cannot be built as nano_eval needs it), so generation re-runs the
    prompt; the backend's build warns once."""
    from nano_eval.backends.megatron_cache import unsupported_reason

    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 20, 0))
    assert compat.static_inference_context(2, 4) is None
    assert unsupported_reason(object()) == "megatron-core 0.20.0 is not in nano_eval's release table"


def test_the_build_warning_is_printed_once(monkeypatch, capsys):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 20, 1))
    monkeypatch.setattr(compat, "_WARNED", set())
    compat.warn_untested_release(is_main=False)
    compat.warn_untested_release()
    compat.warn_untested_release()
    err = capsys.readouterr().err
    assert err.count("nano_eval: warning: megatron-core 0.20.1 is outside") == 1 and err.count("\n") == 1
