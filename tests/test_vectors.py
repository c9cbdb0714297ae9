import math

import pytest
import torch

from nla.core.vectors import cosine, fve, mse_nrm, normalize_activation, predict_mean_baselines, resolve_scale


def test_normalize_scales_to_norm_and_keeps_zero_rows():
    v = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16)
    out = normalize_activation(v, 10.0)
    # [3,4] has norm 5 -> times 10/5 = [6, 8]; the zero row stays zero (no NaN).
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([[6.0, 8.0], [0.0, 0.0]]))


def test_normalize_none_is_noop():
    v = torch.tensor([[3.0, 4.0]], dtype=torch.float16)
    assert normalize_activation(v, None) is v


def test_mse_nrm_orthogonal_identical_opposite():
    d = 4
    scale = math.sqrt(d)
    e0 = torch.tensor([[1.0, 0, 0, 0]])
    e1 = torch.tensor([[0, 5.0, 0, 0]])
    # normalised to norm 2: [2,0,0,0] vs [0,2,0,0] -> squared diff sum 8, mean over d=4 -> 2
    assert mse_nrm(e0, e1, scale).item() == pytest.approx(2.0)
    assert mse_nrm(e0, 7 * e0, scale).item() == pytest.approx(0.0)
    # opposite: [2,..] vs [-2,..] -> 16 / 4 = 4
    assert mse_nrm(e0, -e0, scale).item() == pytest.approx(4.0)


def test_mse_nrm_equals_two_one_minus_cos_on_random():
    torch.manual_seed(0)
    p, g = torch.randn(5, 16), torch.randn(5, 16)
    assert torch.allclose(mse_nrm(p, g, 4.0), 2 * (1 - cosine(p, g)), atol=1e-5)


def test_cosine_by_hand():
    p = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    g = torch.tensor([[0.0, 2.0], [2.0, 2.0]])
    assert torch.allclose(cosine(p, g), torch.tensor([0.0, 1.0]))


def test_fve_three_vector_example():
    # d = 2, scale = 1 (unit vectors). Golds ĝ: e1=[1,0], e2=[0,1], e3=[-1,0].
    # μ = ([1,0]+[0,1]+[-1,0])/3 = [0, 1/3] (not renormalised).
    # raw baseline: rows' mean_d (ĝ-μ)^2:
    #   e1: ((1)^2 + (-1/3)^2)/2 = (1 + 1/9)/2 = 5/9
    #   e2: (0 + (2/3)^2)/2 = (4/9)/2 = 2/9
    #   e3: ((-1)^2 + (1/9))/2 = 5/9
    #   mean = (5/9 + 2/9 + 5/9)/3 = 12/27 = 4/9
    # preds: exact for e1 and e2 (mse 0), orthogonal for e3 (pred [0,1]): mean_d = ((1)^2+(1)^2)/2 = 1
    # mean mse = 1/3; fve = 1 - (1/3)/(4/9) = 1 - 3/4 = 1/4
    gold = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    pred = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    assert fve(pred, gold, 1.0) == pytest.approx(0.25)
    base = predict_mean_baselines(gold, 1.0)
    assert base.raw_mean == pytest.approx(4 / 9)
    # normalised mean: μ/|μ| = [0,1]; mse vs e1: (1+1)/2=1, e2: 0, e3: 1 -> mean 2/3
    assert base.normalized_mean == pytest.approx(2 / 3)


def test_fve_perfect_prediction_is_one_and_matches_loop_reference():
    torch.manual_seed(1)
    gold = torch.randn(6, 8)
    assert fve(gold * 3, gold, 2.0) == pytest.approx(1.0)
    pred = torch.randn(6, 8)
    # plain-loop reference
    g = [row / row.norm() * 2.0 for row in gold]
    p = [row / row.norm() * 2.0 for row in pred]
    mu = sum(g) / len(g)
    num = sum(float(((a - b) ** 2).mean()) for a, b in zip(p, g, strict=True)) / 6
    den = sum(float(((b - mu) ** 2).mean()) for b in g) / 6
    assert fve(pred, gold, 2.0) == pytest.approx(1 - num / den, rel=1e-5)


def test_fve_undefined_on_single_direction():
    gold = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    with pytest.raises(ValueError, match="no spread after normalisation"):
        fve(gold, gold, 1.0)


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\) vs \(2, 4\)"):
        mse_nrm(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)


def test_resolve_scale():
    assert resolve_scale("sqrt_d_model", 16) == 4.0
    assert resolve_scale(150, 16) == 150.0
    assert resolve_scale(None, 16) is None
    with pytest.raises(ValueError, match="'sqrt_d'"):
        resolve_scale("sqrt_d", 16)
    with pytest.raises(ValueError, match="-1"):
        resolve_scale(-1.0, 16)


def test_fve_of_mse_is_one_minus_mean_over_baseline_in_float64():
    from nla.core.vectors import fve_of_mse

    assert fve_of_mse(torch.tensor([1.0, 3.0]), 4.0) == 0.5  # 1 - 2/4
    # float64 mean: 2^24 + 1 is lost in a float32 sum of [2^24, 1, ...] but not here
    mse = torch.tensor([16777216.0, 1.0, 1.0, 0.0], dtype=torch.float32)
    assert fve_of_mse(mse, 1.0) == 1.0 - (16777216.0 + 2.0) / 4
