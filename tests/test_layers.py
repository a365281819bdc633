import pytest

from pipeline.layers import LayerIdError, default_layer_ids, from_convention, hf_reference_index, to_convention, validate


def test_defaults_from_layer_count():
    assert default_layer_ids(30) == [2, 15, 27, 30]
    assert default_layer_ids(61) == [2, 30, 58, 61]


def test_after_layer_convention_round_trip():
    # speculators <= 0.4 captured the output of layer k: its [2, 15, 27, 29] are vLLM [3, 16, 28, 30]
    assert from_convention([2, 15, 27, 29], "after_layer") == [3, 16, 28, 30]
    # SGLang / SpecForge (output-of-layer): vLLM [2, 30, 58] for a 61-layer model = [1, 29, 57]
    assert to_convention([2, 30, 58], "after_layer") == [1, 29, 57]
    with pytest.raises(LayerIdError):
        to_convention([1], "sglang-v2")


def test_validate_rejects_out_of_range_and_unsorted():
    assert validate([2, 15, 27, 30], 30) == [2, 15, 27, 30]
    with pytest.raises(LayerIdError, match=r"out of range.*1\.\.30"):
        validate([2, 15, 31], 30)
    with pytest.raises(LayerIdError, match="out of range"):
        validate([0, 15, 30], 30)
    with pytest.raises(LayerIdError, match="increasing"):
        validate([15, 2, 30], 30)


def test_hf_index_for_final_state_is_a_hook():
    assert hf_reference_index(15, 30) == 15
    assert hf_reference_index(30, 30) is None
