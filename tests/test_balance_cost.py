"""Cost models and the model shape they (and the simulator) derive FLOPs from."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    FlopsCost,
    LinearCost,
    ModelShape,
    QuadraticCost,
    make_cost_model,
    sequence_costs,
)

GOLDEN = DEEPSEEK_R1_DISTILL_QWEN_1_5B


def test_golden_shape_matches_published_config_and_size():
    assert (GOLDEN.num_layers, GOLDEN.hidden, GOLDEN.intermediate) == (28, 1536, 8960)
    assert (GOLDEN.num_heads, GOLDEN.num_kv_heads, GOLDEN.vocab, GOLDEN.head_dim) == (12, 2, 151936, 128)
    # q (with bias), k and v (with bias, 2 KV heads of 128), o, gated MLP, two norms
    per_layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert GOLDEN.layer_params == per_layer
    # untied embedding and LM head plus the final norm; the model card lists 1.78B parameters
    assert GOLDEN.total_params == 28 * per_layer + 2 * 151936 * 1536 + 1536
    assert abs(GOLDEN.total_params - 1.78e9) / 1.78e9 < 0.01


@given(st.integers(1, 200_000))
@settings(max_examples=30, deadline=None)
def test_sequence_flops_formula(s):
    g = GOLDEN
    matmul = 2 * g.hidden * g.num_heads * g.head_dim + 2 * g.hidden * g.num_kv_heads * g.head_dim + 3 * g.hidden * g.intermediate
    expected = 2.0 * s * (g.num_layers * matmul + g.vocab * g.hidden) + 2.0 * g.num_layers * g.num_heads * g.head_dim * s * (s + 1)
    assert GOLDEN.sequence_forward_flops([s])[0] == pytest.approx(expected, rel=1e-12)


def test_model_shape_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape("x", 0, 64, 128, 4, 4, 100)
    with pytest.raises(ValueError, match="divisible"):
        ModelShape("x", 2, 65, 128, 4, 4, 100)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelShape("x", 2, 64, 128, 4, 3, 100)


def test_linear_cost_is_the_token_count():
    np.testing.assert_array_equal(LinearCost()([3, 1, 7]), [3.0, 1.0, 7.0])


def test_quadratic_cost_and_paper_preset():
    model = QuadraticCost(a=2.0, b=3.0, scale=10.0)
    np.testing.assert_allclose(model([10, 20]), [2 + 3, 2 * 4 + 3 * 2])
    paper = QuadraticCost.paper_7b()
    assert paper([32000])[0] == pytest.approx(4.348357 + 8.768377)


@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0))
@settings(max_examples=30, deadline=None)
def test_quadratic_fit_recovers_coefficients(a, b):
    if a + b < 1e-3:
        return
    lengths = np.array([1000, 4000, 9000, 16000, 32000, 64000])
    truth = QuadraticCost(a=a, b=b, scale=32000.0)
    fitted = QuadraticCost.fit(lengths, truth(lengths), scale=32000.0)
    np.testing.assert_allclose(fitted(lengths), truth(lengths), rtol=1e-6, atol=1e-9)


def test_quadratic_fit_keeps_coefficients_non_negative():
    lengths = np.array([1, 2, 3, 4])
    costs = np.array([4.0, 7.0, 9.0, 10.0])  # concave: the free fit would have a < 0
    fitted = QuadraticCost.fit(lengths, costs)
    assert fitted.a >= 0 and fitted.b >= 0
    assert fitted.a == 0  # the best non-negative fit is linear


def test_quadratic_rejects_bad_coefficients_and_fit_input():
    with pytest.raises(ValueError, match=">= 0"):
        QuadraticCost(a=-1.0, b=1.0)
    with pytest.raises(ValueError, match="both zero"):
        QuadraticCost(a=0.0, b=0.0)
    with pytest.raises(ValueError, match="scale"):
        QuadraticCost(a=1.0, b=1.0, scale=0.0)
    with pytest.raises(ValueError, match="two distinct"):
        QuadraticCost.fit([5, 5], [1.0, 1.0])
    with pytest.raises(ValueError, match="differ in size"):
        QuadraticCost.fit([1, 2, 3], [1.0, 2.0])


@given(st.lists(st.integers(1, 131072), min_size=1, max_size=20))
@settings(max_examples=30, deadline=None)
def test_flops_cost_is_the_quadratic_it_reports(lengths):
    flops = FlopsCost(GOLDEN)
    np.testing.assert_allclose(flops(lengths), flops.as_quadratic()(lengths), rtol=1e-12)
    assert np.all(np.diff(flops(sorted(lengths))) >= 0)  # longer never cheaper


def test_make_cost_model_by_name():
    assert make_cost_model("linear") == LinearCost()
    assert make_cost_model("quadratic") == QuadraticCost.paper_7b()
    assert make_cost_model("quadratic", a=1.0, b=2.0) == QuadraticCost(1.0, 2.0)
    assert make_cost_model("flops", shape=GOLDEN) == FlopsCost(GOLDEN)
    with pytest.raises(ValueError, match="unknown cost model"):
        make_cost_model("cubic")
    with pytest.raises(ValueError, match="no parameters"):
        make_cost_model("linear", a=1)
    with pytest.raises(ValueError, match="shape"):
        make_cost_model("flops")


def test_sequence_costs_checks_the_model_output():
    with pytest.raises(ValueError, match="callable"):
        sequence_costs("linear", np.array([1, 2]))
    with pytest.raises(ValueError, match="shape"):
        sequence_costs(lambda s: np.ones(3), np.array([1, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        sequence_costs(lambda s: -np.ones(2), np.array([1, 2]))
