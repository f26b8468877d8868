"""The verdict logic on crafted numbers: pairing by seed, intervals, statuses, and the layer-removal rule."""
import math

import numpy as np
import pytest

from utils.study import verdicts
from utils.study.verdicts import (
    INSIDE_NOISE,
    NOT_MEASURABLE,
    NOT_REPRODUCED,
    OPPOSITE,
    REPRODUCED,
    bootstrap_mean_ci,
    judge_documents,
    judge_layer_removal,
    judge_seeds,
    pair_by_seed,
    paired_bootstrap_ci,
    paired_t_interval,
    t_quantile,
)


@pytest.mark.parametrize("df, expected", [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451),
                                          (10, 2.2281389), (30, 2.0422725)])
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, rel=1e-6)


def test_t_interval_by_hand():
    differences = [1.0, 2.0, 3.0]  # mean 2, sd 1
    mean, low, high = paired_t_interval(differences)
    half_width = 4.3026527 / math.sqrt(3)
    assert (mean, low, high) == pytest.approx((2.0, 2.0 - half_width, 2.0 + half_width), rel=1e-6)


def test_mixed_seeds_pair_only_the_common_ones():
    pre = {0: 3.0, 1: 3.1, 2: 3.2, 5: 9.9}
    lns = {1: 3.0, 2: 3.05, 0: 2.9, 7: 0.1}  # another order, and a seed that Pre-LN does not have
    pairing = pair_by_seed(pre, lns, ("Pre-LN", "LNS"))
    assert pairing.seeds == [0, 1, 2]
    np.testing.assert_array_equal(pairing.b - pairing.a, [2.9 - 3.0, 3.0 - 3.1, 3.05 - 3.2])
    assert set(pairing.dropped) == {5, 7}
    assert "missing in LNS" in pairing.dropped[5] and "missing in Pre-LN" in pairing.dropped[7]
    verdict = judge_seeds("LNS lowers the loss", -1, pre, lns, ("Pre-LN", "LNS"))
    assert verdict.n_pairs == 3 and verdict.effect == pytest.approx(np.mean([-0.1, -0.1, -0.15]))
    assert "seed 5" in verdict.reason and "seed 7" in verdict.reason


def test_a_diverged_seed_is_dropped_not_shifted():
    # Zipping [3.0, 3.2] with [2.9, 3.1] after dropping seed 1 would compare seed 1 of LNS with seed 2 of Pre-LN.
    pre = {0: 3.0, 1: None, 2: 3.2}
    lns = {0: 2.9, 1: 2.5, 2: float("nan")}
    pairing = pair_by_seed(pre, lns)
    assert pairing.seeds == [0]
    assert "diverged" in pairing.dropped[1] and "diverged" in pairing.dropped[2]
    verdict = judge_seeds("LNS lowers the loss", -1, pre, lns)
    assert verdict.status == NOT_MEASURABLE and verdict.effect is None
    three = judge_seeds("LNS lowers the loss", -1, {0: 3.0, 1: float("inf"), 2: 3.2, 3: 3.1},
                        {0: 2.9, 1: 2.5, 2: 3.1, 3: 2.95})
    assert three.n_pairs == 3 and three.effect == pytest.approx(-0.35 / 3)


def test_everything_diverged_is_not_measurable():
    verdict = judge_seeds("claim", 1, {0: None, 1: None}, {0: None, 1: float("nan")})
    assert verdict.status == NOT_MEASURABLE and verdict.n_pairs == 0
    assert "NOT MEASURABLE" in verdict.line()


def test_equal_differences_are_not_measurable_not_certain():
    # two seeds whose discrete measure moves by the same step: a t interval of zero width must not read as reproduced
    verdict = judge_seeds("more layers are cheap to remove", 1, {1: 0.0, 2: 0.0}, {1: 0.125, 2: 0.125})
    assert verdict.status == NOT_MEASURABLE and verdict.effect is None and verdict.n_agree == 2
    assert "+0.125" in verdict.line() and "no width" in verdict.line()
    spread = judge_seeds("more layers are cheap to remove", 1, {1: 0.0, 2: 0.0}, {1: 0.125, 2: 0.1251})
    assert spread.status == REPRODUCED and spread.low > 0


def test_effect_inside_the_noise():
    verdict = judge_seeds("LNS lowers the loss", -1, {0: 3.0, 1: 3.0, 2: 3.0}, {0: 2.9, 1: 3.12, 2: 2.95})
    assert verdict.low < 0 < verdict.high
    assert verdict.status == INSIDE_NOISE


def test_clear_effect_is_reproduced_and_the_opposite_is_opposite():
    pre = {0: 3.00, 1: 3.10, 2: 3.05}
    lns = {0: 2.80, 1: 2.92, 2: 2.86}
    lower = judge_seeds("LNS lowers the loss", -1, pre, lns)
    assert lower.high < 0 and lower.status == REPRODUCED and lower.n_agree == 3
    higher = judge_seeds("LNS raises the loss", +1, pre, lns)
    assert higher.status == OPPOSITE and higher.n_agree == 0


def test_line_shows_effect_interval_and_agreement():
    verdict = judge_seeds("LNS lowers the loss", -1, {0: 3.0, 1: 3.1, 2: 3.05}, {0: 2.8, 1: 2.92, 2: 2.86})
    line = verdict.line()
    assert line.startswith("LNS lowers the loss: REPRODUCED")
    for number in (verdict.effect, verdict.low, verdict.high):
        assert f"{number:+.4g}" in line
    assert "95% CI" in line and "3/3 seeds in the claimed direction" in line


def test_log_ratio_claim():
    pre = {0: 10.0, 1: 12.0, 2: 11.0}
    lns = {0: 2.0, 1: 2.5, 2: 2.1, 3: -1.0}
    verdict = judge_seeds("LNS grows variance less", -1, pre, lns, log_ratio=True)
    assert verdict.n_pairs == 3 and verdict.status == REPRODUCED
    assert verdict.effect == pytest.approx(np.mean(np.log([0.2, 2.5 / 12, 2.1 / 11])))
    assert "ratio x" in verdict.line()


def test_removal_drops_negative_for_both_models_are_not_reproduced():
    pre = {0: -0.030, 1: -0.025, 2: -0.028}
    lns = {0: -0.010, 1: -0.008, 2: -0.012}  # LNS's drop is larger than Pre-LN's in every seed, yet both negative
    verdict = judge_layer_removal("deep Pre-LN layers are cheaper to remove", pre, lns)
    assert verdict.low > 0  # the order alone would have read as reproduced
    assert verdict.status == NOT_REPRODUCED and "helps both models" in verdict.reason
    positive = judge_layer_removal("deep Pre-LN layers are cheaper to remove", {0: 0.01, 1: 0.012, 2: 0.011},
                                   {0: 0.05, 1: 0.06, 2: 0.055})
    assert positive.status == REPRODUCED


def test_bootstrap_interval_covers_the_mean_and_narrows_with_more_data():
    rng = np.random.default_rng(1)
    small = rng.normal(0.3, 1.0, size=50)
    large = rng.normal(0.3, 1.0, size=5000)
    mean_small, low_small, high_small = bootstrap_mean_ci(small, n_boot=2000, seed=0)
    mean_large, low_large, high_large = bootstrap_mean_ci(large, n_boot=2000, seed=0)
    assert low_small < mean_small < high_small and low_large < mean_large < high_large
    assert high_large - low_large < (high_small - low_small) / 5
    standard_error = large.std(ddof=1) / math.sqrt(large.size)
    assert high_large - low_large == pytest.approx(2 * 1.96 * standard_error, rel=0.1)


def test_documents_verdict_pairs_by_position():
    rng = np.random.default_rng(2)
    pre = rng.normal(4.0, 0.5, size=400)
    lns = pre - 0.05 + rng.normal(0, 0.02, size=400)  # same documents: a small effect, far outside the noise
    lns[3] = np.nan
    verdict = judge_documents("LNS lowers the per-document loss", -1, pre, lns, n_boot=2000)
    assert verdict.status == REPRODUCED and verdict.n_pairs == 399 and "1 of 400 documents" in verdict.reason
    effect, low, high = paired_bootstrap_ci(np.delete(pre, 3), np.delete(lns, 3), n_boot=2000)
    assert verdict.effect == pytest.approx(effect)
    assert judge_documents("c", 1, [1.0], [2.0]).status == NOT_MEASURABLE


def test_bad_direction_is_an_error():
    with pytest.raises(ValueError, match="expected_direction"):
        judge_seeds("claim", 0, {0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})


def test_statuses_are_the_documented_ones():
    assert set(verdicts.STATUSES) == {"reproduced", "opposite", "inside noise", "not measurable", "not reproduced"}
