"""apmpo.loss against hand-computed cases and a slow per-token reference written in ratio space.

The kernel works on log-ratios with a log-space power mean; the reference below works on ratios
r = pi/pi_old with Python loops over sequences and tokens, straight from the paper's equations
(Eq. 7-9, Appendix A), in float64. The two share no code.
"""
import math

import pytest
import torch

from apmpo.loss import (
    POLICY_LOSSES,
    SMALL_P,
    AdaptiveParams,
    LossConfig,
    PolicyLoss,
    adaptive_params,
    advantages_for,
    group_advantages,
    kl_penalty,
    policy_loss,
    power_mean,
)

# Every registered loss; Dr. GRPO needs its constant (the other losses ignore it).
ALL_LOSSES = list(POLICY_LOSSES)
BUDGET = 32

# --------------------------------------------------------------------------- the reference


def reference_objective(logp, old_logp, adv, mask, name, eps_low, eps_high, p, gmpo_clip=0.4):
    """J of the paper, per token in ratio space. p and eps_high: floats or per-sequence lists."""
    N, T = logp.shape
    per_seq, tokens = [], []
    for i in range(N):
        A = adv[i]
        p_i = p[i] if isinstance(p, (list, tuple)) else p
        hi = eps_high[i] if isinstance(eps_high, (list, tuple)) else eps_high
        U = []  # min(r A, clip(r, lo, hi) A) per token
        for t in range(T):
            if not mask[i][t]:
                continue
            r = torch.exp(logp[i, t] - old_logp[i, t])
            if name == "gmpo":
                # Appendix A with the sign convention of SPEC.md: clip log r sign-aware to [-c, c].
                log_r = torch.log(r)
                clipped = torch.clamp(log_r, -gmpo_clip, gmpo_clip)
                U.append(torch.minimum(log_r, clipped) if A >= 0 else torch.maximum(log_r, clipped))
                continue
            rho = torch.clamp(r, 1 - eps_low, 1 + hi)
            U.append(torch.minimum(r * A, rho * A))
        n = len(U)
        tokens.append(U)
        if name in ("grpo", "dapo"):
            per_seq.append(sum(U) / n)
        elif name == "gmpo":
            per_seq.append(A * torch.exp(sum(U) / n))
        elif A == 0:
            per_seq.append(torch.zeros((), dtype=logp.dtype))  # sgn(0) = 0
        else:
            phi = [torch.abs(u) for u in U]
            if p_i == 0:  # the limit p -> 0: geometric mean
                M = torch.exp(sum(torch.log(x) for x in phi) / n)
            else:
                M = (sum(x**p_i for x in phi) / n) ** (1 / p_i)
            per_seq.append(math.copysign(1.0, A) * M)
    if name == "dapo":
        return sum(u for U in tokens for u in U) / sum(len(U) for U in tokens)
    return sum(per_seq) / N


def random_batch(N, T, seed, scale=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=dtype) * 3
    logp = old + torch.randn(N, T, generator=g, dtype=dtype) * scale
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(N, generator=g, dtype=dtype)
    adv[0] = 0.0  # always one zero-advantage row
    return logp, old, adv, mask


def params_for(p, eps_ada):
    t = lambda x: torch.as_tensor(x, dtype=torch.float32)
    return AdaptiveParams(p=t(p), eps_ada=t(eps_ada), fss=t(0.0), mu=t(0.0), sigma=t(0.0))


def kernel_value_and_grad(logp, old, adv, mask, cfg, params):
    x = logp.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, cfg, params)
    loss.backward()
    return loss.detach().double(), x.grad.double(), metrics


def reference_value_and_grad(logp, old, adv, mask, **kw):
    x = logp.detach().clone().double().requires_grad_(True)
    J = reference_objective(x, old.double(), adv.tolist(), mask.tolist(), **kw)
    (-J).backward()
    return -J.detach(), x.grad


def reference_dr_grpo(logp, old_logp, adv, mask, eps_low, eps_high, budget):
    """Dr. GRPO (Liu et al. 2025, Eq. 3 and its code): GRPO's token term, summed over every token of every
    sequence with no 1/|o_i|, divided by the constant N * budget (TRL: batch size * max_completion_length)."""
    N, T = logp.shape
    total = torch.zeros((), dtype=logp.dtype)
    for i in range(N):
        for t in range(T):
            if mask[i][t]:
                r = torch.exp(logp[i, t] - old_logp[i, t])
                total = total + torch.minimum(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
    return total / (N * budget)


def reference_gspo(logp, old_logp, adv, mask, eps_low, eps_high):
    """GSPO (Zheng et al. 2025, Eq. 5-7): s_i = (prod_t r_i,t)^(1/|o_i|), the sequence's importance ratio;
    J = (1/N) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i). Products of ratios, not log means."""
    N, T = logp.shape
    J = torch.zeros((), dtype=logp.dtype)
    for i in range(N):
        toks = [t for t in range(T) if mask[i][t]]
        prod = torch.ones((), dtype=logp.dtype)
        for t in toks:
            prod = prod * torch.exp(logp[i, t] - old_logp[i, t])
        s = prod ** (1 / len(toks))
        J = J + torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
    return J / N


def reference_gspo_token(logp, old_logp, adv, mask, eps_low, eps_high):
    """GSPO-token (Zheng et al. 2025, Eq. 13-14): s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], token terms averaged
    over each sequence. With one advantage per sequence its value and gradient are GSPO's."""
    N, T = logp.shape
    J = torch.zeros((), dtype=logp.dtype)
    for i in range(N):
        toks = [t for t in range(T) if mask[i][t]]
        s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in toks) / len(toks)).detach()
        U = []
        for t in toks:
            s_t = s * torch.exp(logp[i, t] - logp[i, t].detach())
            U.append(torch.minimum(s_t * adv[i], torch.clamp(s_t, 1 - eps_low, 1 + eps_high) * adv[i]))
        J = J + sum(U) / len(U)
    return J / N


def reference_grad(objective, logp, old, adv, mask, *args):
    """-J of a reference objective and its gradient, in float64."""
    x = logp.detach().clone().double().requires_grad_(True)
    J = objective(x, old.double(), adv.double().tolist(), mask.tolist(), *args)
    (-J).backward()
    return -J.detach(), x.grad


# --------------------------------------------------------------------------- hand-computed cases


def test_hand_apmpo_p1_upper_clip():
    # A = 1, r = [1.1, 1.5], eps_ada = 0.3: rho' = [1.1, min(1.5, 1.3) = 1.3]; M_1 = (1.1 + 1.3)/2 = 1.2; loss = -1.2.
    # Gradient: token 0 unclipped, d/dlogp (A r / n) = 1.1/2 = 0.55 -> loss grad -0.55; token 1 clipped -> 0.
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.1, 1.5]])).requires_grad_(True)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(), params_for(1.0, 0.3))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert logp.grad.tolist()[0] == pytest.approx([-0.55, 0.0], abs=1e-6)
    assert m["loss/clip_frac_upper"].item() == pytest.approx(0.5)


def test_hand_apmpo_half_power():
    # A = 2, r = [1.0, 1.21], eps_ada = 0.3 (no clip): phi = 2 * [1, 1.21].
    # M_0.5(rho') = ((sqrt(1) + sqrt(1.21)) / 2)^2 = (2.1/2)^2 = 1.1025; J = A * M = 2.205; loss = -2.205.
    # Appendix H: dJ/dlogp_t = (1/n) M_p(phi)^(1-p) phi_t^(p-1) A r_t, M_p(phi) = 2.205:
    #   t=0: 0.5 * 2.205^0.5 * 2^-0.5 * 2 * 1      = 0.5 * 1.48492 * 0.70711 * 2    = 1.05
    #   t=1: 0.5 * 2.205^0.5 * 2.42^-0.5 * 2 * 1.21 = 0.5 * 1.48492 * 0.64282 * 2.42 = 1.155
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.0, 1.21]])).requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.tensor([2.0]), torch.ones(1, 2), LossConfig(), params_for(0.5, 0.3))
    loss.backward()
    assert loss.item() == pytest.approx(-2.205, abs=1e-5)
    assert logp.grad.tolist()[0] == pytest.approx([-1.05, -1.155], abs=1e-5)


def test_hand_negative_advantage_lower_clip():
    # A = -1, r = [0.5, 1.0], eps_low = 0.2: rho' = max(r, 0.8) = [0.8, 1.0]; p = 1: M = 0.9, J = -0.9, loss = 0.9.
    # Token 0 is clipped (no gradient); token 1: dJ/dlogp = A r / n = -0.5 -> loss grad +0.5.
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[0.5, 1.0]])).requires_grad_(True)
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), LossConfig(), params_for(1.0, 0.3))
    loss.backward()
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.5], abs=1e-6)
    assert m["loss/clip_frac_lower"].item() == pytest.approx(0.5)


def test_hand_geometric_and_harmonic():
    # x = [0.81, 1.0] (masked third entry ignored): geometric mean sqrt(0.81) = 0.9;
    # harmonic (p = -1): 2 / (1/0.81 + 1) = 2 / 2.2345679 = 0.8950276; quadratic (p = 2): sqrt((0.6561 + 1)/2) = sqrt(0.82805) = 0.9099725.
    log_x = torch.log(torch.tensor([[0.81, 1.0, 5.0]]))
    mask = torch.tensor([[1, 1, 0]])
    assert power_mean(log_x, mask, 0.0).exp().item() == pytest.approx(0.9, abs=1e-7)
    assert power_mean(log_x, mask, -1.0).exp().item() == pytest.approx(0.8950276, abs=1e-6)
    assert power_mean(log_x, mask, 2.0).exp().item() == pytest.approx(0.9099725, abs=1e-6)


def test_hand_adaptive_params():
    # rewards [[1, 0], [1, 1]]: mu = 0.75, sigma = sqrt(0.75 * 0.25) = 0.4330127;
    # FSS = 0.75 / 0.4330137 = 1.7320468; tanh(FSS) = 0.9392973; eps_ada = 0.2 + 0.2 * 0.9392973 = 0.3878595;
    # p = exp(-0.8 * 0.75) = exp(-0.6) = 0.5488116.
    params = adaptive_params(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), LossConfig())
    assert params.mu.item() == pytest.approx(0.75)
    assert params.sigma.item() == pytest.approx(0.4330127, abs=1e-6)
    assert params.fss.item() == pytest.approx(1.7320468, abs=1e-5)
    assert params.eps_ada.item() == pytest.approx(0.3878595, abs=1e-6)
    assert params.p.item() == pytest.approx(0.5488116, abs=1e-6)
    # linear schedule: p = 1 - 0.8 * 0.75 = 0.4; mu_only: eps = 0.2 + 0.2 tanh(0.75) = 0.3270298;
    # sigma_only: eps = 0.2 + 0.2 tanh(1/0.4330137) = 0.2 + 0.2 * 0.9804633 = 0.3960927.
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert adaptive_params(r, LossConfig(p_schedule="linear")).p.item() == pytest.approx(0.4, abs=1e-6)
    assert adaptive_params(r, LossConfig(fss="mu_only")).eps_ada.item() == pytest.approx(0.3270298, abs=1e-6)
    assert adaptive_params(r, LossConfig(fss="sigma_only")).eps_ada.item() == pytest.approx(0.3960927, abs=1e-6)
    # Group scope: row 0 (mu .5, sigma .5, FSS 0.999998, eps 0.2 + 0.2 * 0.7615934 = 0.3523186, p = exp(-.4));
    # row 1 (mu 1, sigma 0, FSS 1e6 -> eps_max = 0.4, p = exp(-0.8) = 0.4493290).
    g = adaptive_params(r, LossConfig(stats_scope="group"))
    assert g.eps_ada.tolist() == pytest.approx([0.3523186, 0.4], abs=1e-6)
    assert g.p.tolist() == pytest.approx([math.exp(-0.4), 0.4493290], abs=1e-6)
    # Switched off: PMPO alone keeps eps_high; GRPO+FAC keeps p = 1.
    assert adaptive_params(r, LossConfig(fac=False)).eps_ada.item() == pytest.approx(0.2)
    assert adaptive_params(r, LossConfig(pmpo=False)).p.item() == 1.0


def test_hand_group_advantages():
    # [1, 0, 0, 0]: mean 0.25, std sqrt(0.25 * 0.75) = 0.4330127 -> 0.75 / 0.4330137 = 1.7320468, -0.25/0.4330137 = -0.5773489.
    # [0.1] * 4 rounds to a mean that is not exactly 0.1, yet an all-equal group must give exactly 0.
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]]))
    assert adv[0].tolist() == pytest.approx([1.7320468, -0.5773489, -0.5773489, -0.5773489], abs=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_hand_kl_estimators():
    # logp = log 0.5, ref = log 0.25: log(ref/pi) = -log 2 = -0.6931472.
    # k1 = log(pi/ref) = 0.6931472; k2 = 0.5 * 0.480453 = 0.2402265; k3 = 0.5 - 1 + 0.6931472 = 0.1931472.
    logp, ref, mask = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]])), torch.ones(1, 1)
    for est, want in (("k1", 0.6931472), ("k2", 0.2402265), ("k3", 0.1931472)):
        assert kl_penalty(logp, ref, mask, LossConfig(kl_estimator=est)).item() == pytest.approx(want, abs=1e-6)


def test_paper_defaults_by_name():
    assert LossConfig(name="grpo").eps_high == 0.2
    assert LossConfig(name="dapo").eps_high == 0.28
    cfg = LossConfig()
    assert (cfg.gamma, cfg.eps_min, cfg.eps_max, cfg.eps_low, cfg.delta, cfg.kl_beta) == (0.8, 0.2, 0.4, 0.2, 1e-6, 0.001)
    with pytest.raises(ValueError, match="name"):
        LossConfig(name="ppo")


def test_hand_dr_grpo():
    # One group, rewards [1, 0]: Dr. GRPO's advantage is R - mean = [0.5, -0.5] (GRPO's would be [1, -1]).
    # Seq 0 (A = 0.5): r = [1.1, 1.5]  -> min(r, 1.2) A = [0.55, 0.6],  token sum 1.15.
    # Seq 1 (A = -0.5): r = [0.5, 1.0] -> max(r, 0.8) A = [-0.4, -0.5], token sum -0.9.
    # J = (1.15 - 0.9) / (N * budget) = 0.25 / (2 * 4) = 0.03125; loss = -0.03125.
    # Gradient of the loss, -A r / (N budget) where unclipped: (0,0): -0.5 * 1.1 / 8 = -0.06875; (1,1): +0.5 / 8
    # = +0.0625; (0,1) and (1,0) clipped -> 0. No 1/|o_i|: a longer sequence would not scale these down.
    cfg = LossConfig(name="dr_grpo", token_budget=4)
    adv = advantages_for(torch.tensor([[1.0, 0.0]]), cfg).flatten().double()  # fp64: exact clip bounds too
    assert adv.tolist() == [0.5, -0.5]
    logp = torch.log(torch.tensor([[1.1, 1.5], [0.5, 1.0]], dtype=torch.float64)).requires_grad_(True)
    loss, m = policy_loss(logp, torch.zeros(2, 2, dtype=torch.float64), adv, torch.ones(2, 2), cfg,
                          adaptive_params(torch.tensor([[1.0, 0.0]]), cfg))
    loss.backward()
    assert loss.item() == pytest.approx(-0.03125, abs=1e-12)
    assert logp.grad.flatten().tolist() == pytest.approx([-0.06875, 0.0, 0.0, 0.0625], abs=1e-12)
    assert (m["loss/clip_frac_upper"].item(), m["loss/clip_frac_lower"].item()) == (0.25, 0.25)


def test_hand_dr_grpo_advantages_are_not_std_normalised():
    # [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25] (GRPO: / 0.4330137 -> 1.7320468, -0.5773489);
    # [0.1] * 4 is all-equal: exactly 0 although 0.1 - mean(0.1 x 4) rounds to a tiny non-zero in fp32.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    adv = advantages_for(rewards, LossConfig(name="dr_grpo", token_budget=1))
    assert adv.tolist() == [[0.75, -0.25, -0.25, -0.25], [0.0, 0.0, 0.0, 0.0]]
    for name in ("apmpo", "grpo", "dapo", "gmpo", "gspo"):
        torch.testing.assert_close(advantages_for(rewards, LossConfig(name=name)), group_advantages(rewards))


def test_hand_gspo():
    # GSPO's defaults clip the sequence ratio s to [1 - 3e-4, 1 + 4e-4]. Log-ratios l = logp - old:
    # seq 0, A = +1, l = [1e-4, 3e-4]:  log s = 2e-4,  s = e^2e-4 = 1.0002000200 <= 1.0004: kept, J_0 = 1.00020002;
    # seq 1, A = -1, l = [-2e-4, -6e-4]: log s = -4e-4, s = 0.99960008 < 0.9997: A < 0 takes max(s, 0.9997),
    #   clipped, J_1 = -0.9997;
    # seq 2, A = +2, l = [1e-3]: s = 1.0010005 > 1.0004: clipped, J_2 = 2 * 1.0004 = 2.0008.
    # J = (1.00020002 - 0.9997 + 2.0008) / 3 = 2.00130002 / 3 = 0.66710001; loss = -0.66710001.
    # Gradient: only seq 0, dJ/dl_t = A s / (N |o_0|) = 1.00020002 / 6 = 0.16670000 -> loss grad -0.16670000.
    # Clip fractions count tokens of clipped sequences: lower 2 of 5 tokens, upper 1 of 5.
    cfg = LossConfig(name="gspo")
    assert (cfg.eps_low, cfg.eps_high) == (3e-4, 4e-4)
    logp = torch.tensor([[1e-4, 3e-4], [-2e-4, -6e-4], [1e-3, 0.0]], dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, m = policy_loss(logp, torch.zeros(3, 2, dtype=torch.float64), adv, mask, cfg, params_for(0.0, 4e-4))
    loss.backward()
    want = (math.exp(2e-4) - 0.9997 + 2.0008) / 3
    assert want == pytest.approx(0.66710001, abs=1e-8)
    assert loss.item() == pytest.approx(-want, abs=1e-12)
    assert logp.grad.flatten().tolist() == pytest.approx([-math.exp(2e-4) / 6] * 2 + [0.0] * 4, abs=1e-12)
    assert logp.grad[0, 0].item() == pytest.approx(-0.16670000, abs=1e-8)
    assert (m["loss/clip_frac_lower"].item(), m["loss/clip_frac_upper"].item()) == pytest.approx((0.4, 0.2))


def test_registry_defaults_and_rules():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # GSPO: the geometric sequence mean (p = 0) and its tiny fixed clip; Dr. GRPO: GRPO's p = 1 and eps 0.2.
    gspo = adaptive_params(rewards, LossConfig(name="gspo"))
    assert (gspo.p.item(), gspo.eps_ada.item()) == (0.0, pytest.approx(4e-4))
    dr = adaptive_params(rewards, LossConfig(name="dr_grpo", token_budget=8))
    assert (dr.p.item(), dr.eps_ada.item()) == (1.0, pytest.approx(0.2))
    assert LossConfig(name="gspo", eps_high=1e-3).eps_high == 1e-3  # an explicit value beats the default
    with pytest.raises(ValueError, match=r"loss.name must be one of \['apmpo', 'grpo', 'dapo', 'gmpo', "
                       r"'dr_grpo', 'gspo'\], got 'nope'"):
        LossConfig(name="nope")
    with pytest.raises(ValueError, match=r"loss.name='dr_grpo' needs loss.token_budget > 0"):
        LossConfig(name="dr_grpo")


def test_a_new_loss_is_one_function_and_one_entry(monkeypatch):
    # REINFORCE with the sequence's mean log-prob: registered at run time, it is a valid name, its rules set
    # p and eps_ada, its advantage rule and its defaults apply, and policy_loss dispatches to it.
    def reinforce(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None,
                  token_weights=None):
        maskf = mask.to(logp.dtype)
        return -(advantages * (logp * maskf).sum(-1) / maskf.sum(-1)).mean(), {}

    entry = PolicyLoss(reinforce, p=lambda mu, cfg: 2 * mu, eps=lambda fss, cfg: 0.5, eps_low=0.1,
                       std_advantages=False)
    monkeypatch.setitem(POLICY_LOSSES, "reinforce", entry)
    cfg = LossConfig(name="reinforce")
    assert cfg.eps_low == 0.1
    # rewards [[1, 0]]: mu = 0.5 -> p = 2 mu = 1; advantages R - mean = [0.5, -0.5];
    # loss = -mean(0.5 * mean(log 0.5, log 0.5), -0.5 * log 0.25) = -(0.5 * -0.6931472 + 0.5 * 1.3862944) / 2
    # = -0.1732868.
    rewards = torch.tensor([[1.0, 0.0]])
    params = adaptive_params(rewards, cfg)
    assert (params.p.item(), params.eps_ada.item()) == (1.0, 0.5)
    adv = advantages_for(rewards, cfg).flatten()
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 1.0]]))
    loss, metrics = policy_loss(logp, logp, adv, torch.tensor([[1, 1], [1, 0]]), cfg, params)
    assert loss.item() == pytest.approx(-0.1732868, abs=1e-6)
    assert metrics["apmpo/p"].item() == 1.0


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "name,p,clip_mode",
    [("apmpo", 0.7, "asymmetric"), ("apmpo", 1.0, "asymmetric"), ("apmpo", 0.3, "symmetric"),
     ("apmpo", -0.5, "asymmetric"), ("apmpo", -2.0, "asymmetric"), ("apmpo", 2.5, "asymmetric"),
     ("apmpo", 0.0, "asymmetric"), ("grpo", None, None), ("dapo", None, None), ("gmpo", None, None)],
)
def test_matches_reference(seed, name, p, clip_mode):
    g = torch.Generator().manual_seed(100 + seed)
    N, T = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
    logp, old, adv, mask = random_batch(N, T, seed)
    if name == "apmpo":
        cfg, eps_ada = LossConfig(clip_mode=clip_mode), 0.33
        params = params_for(p, eps_ada)
        lo = eps_ada if clip_mode == "symmetric" else cfg.eps_low
        kw = dict(name="apmpo", eps_low=lo, eps_high=eps_ada, p=p)
    else:
        cfg = LossConfig(name=name)
        params = adaptive_params(torch.rand(2, 4), cfg)
        kw = dict(name=name, eps_low=cfg.eps_low, eps_high=cfg.eps_high, p=1.0)
    value, grad, _ = kernel_value_and_grad(logp.float(), old.float(), adv.float(), mask, cfg, params)
    ref_value, ref_grad = reference_value_and_grad(logp.float(), old.float(), adv.float(), mask, **kw)
    assert value.item() == pytest.approx(ref_value.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_group_scope_matches_reference(seed):
    B, G, T = 3, 4, 9
    logp, old, adv, mask = random_batch(B * G, T, seed)
    cfg = LossConfig(stats_scope="group")
    rewards = (torch.rand(B, G, generator=torch.Generator().manual_seed(seed)) > 0.4).float()
    params = adaptive_params(rewards, cfg).per_sequence(torch.arange(B).repeat_interleave(G))
    value, grad, m = kernel_value_and_grad(logp.float(), old.float(), adv.float(), mask, cfg, params)
    ref_value, ref_grad = reference_value_and_grad(
        logp.float(), old.float(), adv.float(), mask, name="apmpo", eps_low=0.2,
        eps_high=params.eps_ada.tolist(), p=params.p.tolist(),
    )
    assert value.item() == pytest.approx(ref_value.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [0.3, 0.02])
def test_dr_grpo_matches_reference(seed, scale):
    g = torch.Generator().manual_seed(200 + seed)
    N, T = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
    logp, old, adv, mask = random_batch(N, T, seed, scale=scale)
    cfg = LossConfig(name="dr_grpo", token_budget=T + 3)
    value, grad, _ = kernel_value_and_grad(logp.float(), old.float(), adv.float(), mask, cfg,
                                           adaptive_params(torch.rand(2, 4), cfg))
    ref_value, ref_grad = reference_grad(reference_dr_grpo, logp.float(), old.float(), adv.float(), mask,
                                         cfg.eps_low, cfg.eps_high, T + 3)
    assert value.item() == pytest.approx(ref_value.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale,eps_low,eps_high", [(3e-4, None, None), (0.3, 0.2, 0.28), (0.02, 0.01, 0.02)])
def test_gspo_matches_reference_and_its_token_form(seed, scale, eps_low, eps_high):
    # Scales chosen so that some sequences are clipped and some are not (checked below).
    g = torch.Generator().manual_seed(300 + seed)
    N, T = int(torch.randint(4, 12, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
    logp, old, adv, mask = random_batch(N, T, seed, scale=scale)
    cfg = LossConfig(name="gspo", eps_low=eps_low, eps_high=eps_high)
    # fp64 inputs: at GSPO's eps the sequence ratios differ from 1 by ~1e-4, below fp32's relative resolution
    # of a clean comparison with the float64 reference.
    value, grad, m = kernel_value_and_grad(logp, old, adv, mask, cfg, adaptive_params(torch.rand(2, 4), cfg))
    args = (logp, old, adv, mask, cfg.eps_low, cfg.eps_high)
    for reference in (reference_gspo, reference_gspo_token):
        ref_value, ref_grad = reference_grad(reference, *args)
        assert value.item() == pytest.approx(ref_value.item(), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_gspo_reference_cases_clip_some_sequences_and_not_others():
    # The reference test above is only meaningful when both branches occur: count them on its batches.
    for scale, lo, hi in ((3e-4, 3e-4, 4e-4), (0.3, 0.2, 0.28), (0.02, 0.01, 0.02)):
        kept = clipped = 0
        for seed in range(4):
            g = torch.Generator().manual_seed(300 + seed)
            N, T = int(torch.randint(4, 12, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
            logp, old, adv, mask = random_batch(N, T, seed, scale=scale)
            s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
            out = ((adv > 0) & (s > 1 + hi)) | ((adv < 0) & (s < 1 - lo))
            clipped += int(out.sum())
            kept += int((~out & (adv != 0)).sum())
        assert kept > 0 and clipped > 0, (scale, kept, clipped)


@pytest.mark.parametrize("p", [0.8, 0.3, -0.7])
def test_gradient_equals_appendix_h(p):
    """dJ_i/dlogp_t = (1/n) M_p(phi)^(1-p) phi_t^(p-1) * dU_t/dlogp_t, dU_t = A r_t where unclipped, else 0."""
    logp, old, adv, mask = random_batch(6, 10, seed=7, scale=0.4)
    eps_ada, eps_low = 0.3, 0.2
    _, grad, _ = kernel_value_and_grad(logp.float(), old.float(), adv.float(), mask, LossConfig(), params_for(p, eps_ada))
    N = logp.shape[0]
    want = torch.zeros_like(logp)
    for i in range(N):
        A = adv[i].item()
        if A == 0:
            continue
        toks = [t for t in range(logp.shape[1]) if mask[i, t]]
        r = {t: math.exp(logp[i, t] - old[i, t]) for t in toks}
        rho = {t: min(max(r[t], 1 - eps_low), 1 + eps_ada) for t in toks}
        phi = {t: abs(min(r[t] * A, rho[t] * A)) for t in toks}
        M = (sum(phi[t] ** p for t in toks) / len(toks)) ** (1 / p)
        for t in toks:
            unclipped = (r[t] * A <= rho[t] * A)  # min picks r A
            dU = A * r[t] if unclipped else 0.0
            want[i, t] = -(M ** (1 - p)) * phi[t] ** (p - 1) * dU / len(toks) / N  # loss = -J
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- limits and equivalences


def test_p1_is_grpo_exactly():
    logp, old, adv, mask = random_batch(16, 20, seed=3)
    args = (logp.float(), old.float(), adv.float(), mask)
    grpo = kernel_value_and_grad(*args, LossConfig(name="grpo"), params_for(1.0, 0.2))
    pmpo_off = LossConfig(name="apmpo", pmpo=False, fac=False)
    apmpo = kernel_value_and_grad(*args, pmpo_off, adaptive_params(torch.rand(4, 4), pmpo_off))
    assert apmpo[0].item() == pytest.approx(grpo[0].item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(apmpo[1], grpo[1], rtol=1e-5, atol=1e-7)


def test_p0_is_gmpo_geometric_mean_with_same_clipping():
    logp, old, adv, mask = random_batch(16, 20, seed=4)
    args = (logp.float(), old.float(), adv.float(), mask)
    # apmpo at p = 0 with upper clip e^0.4 - 1 and lower 1 - e^-0.4 is GMPO exactly.
    cfg = LossConfig(eps_low=-math.expm1(-0.4))
    apmpo = kernel_value_and_grad(*args, cfg, params_for(0.0, math.expm1(0.4)))
    gmpo = kernel_value_and_grad(*args, LossConfig(name="gmpo"), params_for(0.0, 0.0))
    assert apmpo[0].item() == pytest.approx(gmpo[0].item(), rel=1e-6)
    torch.testing.assert_close(apmpo[1], gmpo[1], rtol=1e-5, atol=1e-7)
    # and p -> 0 from either side converges to it
    for p in (1e-7, -1e-7, 1e-4):
        near = kernel_value_and_grad(*args, cfg, params_for(p, math.expm1(0.4)))
        assert near[0].item() == pytest.approx(apmpo[0].item(), rel=2e-4)


def test_continuous_across_small_p_threshold():
    g = torch.Generator().manual_seed(0)
    log_x = (torch.randn(5, 30, generator=g) * 0.5).requires_grad_(True)
    mask = torch.rand(5, 30, generator=g) > 0.2
    results = []
    for p in (SMALL_P * (1 - 1e-6), SMALL_P * (1 + 1e-6), -SMALL_P * (1 - 1e-6), -SMALL_P * (1 + 1e-6)):
        log_x.grad = None
        v = power_mean(log_x, mask, p)
        v.sum().backward()
        results.append((v.detach(), log_x.grad.clone()))
    for below, above in (results[0:2], results[2:4]):
        torch.testing.assert_close(below[0], above[0], rtol=0, atol=2e-7)
        torch.testing.assert_close(below[1], above[1], rtol=0, atol=2e-7)


@pytest.mark.parametrize("p", [3.0, 1.0, 0.5, 0.01, 2e-3, 5e-4, 1e-6, 0.0, -1e-4, -0.3, -1.0, -4.0])
def test_power_mean_against_float64(p):
    g = torch.Generator().manual_seed(1)
    log_x = torch.randn(7, 25, generator=g, dtype=torch.float64) * 0.4
    mask = torch.rand(7, 25, generator=g) > 0.3
    mask[:, 0] = True
    got = power_mean(log_x.float(), mask, p).double()
    for i in range(7):
        xs = log_x[i][mask[i]]
        want = xs.mean() if p == 0 else torch.log(torch.exp(p * xs).mean()) / p
        assert got[i].item() == pytest.approx(want.item(), abs=3e-7)


def test_power_mean_extreme_log_ratios_stay_finite():
    # A clamped log-ratio is unbounded on one side: -40 with p = -1 would overflow exp(-p * log x) naively.
    log_x = torch.tensor([[-40.0, 0.1, 0.2], [30.0, -0.1, 0.0]], requires_grad=True)
    mask = torch.ones(2, 3)
    for p in (-1.0, 1.0, 2.0, 0.0):
        v = power_mean(log_x, mask, p)
        v.sum().backward()
        assert torch.isfinite(v).all() and torch.isfinite(log_x.grad).all()
        log_x.grad = None
    # p = -1 is dominated by the smallest entry: log(3 / sum(1/x)) ~ -40 + log 3
    assert power_mean(log_x, mask, -1.0)[0].item() == pytest.approx(-40 + math.log(3), abs=1e-4)


def test_p_tensor_on_host_per_row_mixed_branches():
    g = torch.Generator().manual_seed(2)
    log_x = torch.randn(4, 12, generator=g) * 0.3
    mask = torch.ones(4, 12, dtype=torch.bool)
    p = torch.tensor([0.5, 0.0, -2.0, 1e-5])
    rows = power_mean(log_x, mask, p)
    for i in range(4):
        assert rows[i].item() == pytest.approx(power_mean(log_x[i : i + 1], mask[i : i + 1], p[i].item()).item(), abs=1e-7)


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("rewards", [torch.zeros(4, 8), torch.ones(4, 8), torch.full((4, 8), 0.3)])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_all_equal_groups_give_zero_loss_no_nan(rewards, name):
    cfg = LossConfig(name=name, token_budget=BUDGET)
    params = adaptive_params(rewards, cfg)
    assert all(torch.isfinite(getattr(params, f)).all() for f in ("p", "eps_ada", "fss", "mu", "sigma"))
    adv = advantages_for(rewards, cfg).flatten()
    logp, old, _, mask = random_batch(32, 16, seed=5, dtype=torch.float32)
    logp.requires_grad_(True)
    loss, metrics = policy_loss(logp, old, adv, mask, cfg, params)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_all_zero_and_all_one_reward_params():
    # All zero: mu = sigma = 0 -> FSS = 0, eps_ada = eps_min (tanh 0 = 0), p = 1.
    zero = adaptive_params(torch.zeros(4, 8), LossConfig())
    assert (zero.fss.item(), zero.eps_ada.item(), zero.p.item()) == (0.0, pytest.approx(0.2), 1.0)
    # All one: sigma = 0 -> FSS = 1/delta = 1e6, eps_ada = eps_max, p = exp(-0.8).
    one = adaptive_params(torch.ones(4, 8), LossConfig())
    assert one.eps_ada.item() == pytest.approx(0.4) and one.p.item() == pytest.approx(math.exp(-0.8))


def test_bad_shapes_and_empty_masks_are_rejected():
    logp, old, adv, mask = random_batch(3, 5, seed=0, dtype=torch.float32)
    cfg, params = LossConfig(), params_for(0.5, 0.3)
    with pytest.raises(ValueError, match=r"old_logp has shape \(3, 4\)"):
        policy_loss(logp, old[:, :4], adv, mask, cfg, params)
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\)"):
        policy_loss(logp, old, adv[:2], mask, cfg, params)
    with pytest.raises(ValueError, match=r"mask has shape"):
        policy_loss(logp, old, adv, mask[:2], cfg, params)
    with pytest.raises(ValueError, match=r"logp must be \[N, T\]"):
        policy_loss(logp[0], old[0], adv, mask[0], cfg, params)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"rows without tokens: \[1\]"):
        policy_loss(logp, old, adv, empty, cfg, params)
    with pytest.raises(ValueError, match=r"params.p has shape \(2,\)"):
        policy_loss(logp, old, adv, mask, cfg, params_for([0.5, 0.5], 0.3))
    with pytest.raises(ValueError, match=r"rewards must be a tensor \[B, G\]"):
        adaptive_params(torch.ones(8), cfg)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_bf16_inputs(name):
    logp, old, adv, mask = random_batch(8, 32, seed=6, dtype=torch.float32)
    logp16, old16 = logp.bfloat16(), old.bfloat16()
    cfg, params = LossConfig(name=name, token_budget=BUDGET), params_for(0.6, 0.3)
    x16 = logp16.clone().requires_grad_(True)
    loss16, _ = policy_loss(x16, old16, adv, mask, cfg, params)
    loss16.backward()
    assert loss16.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16
    # The same rounded inputs in fp32 give the same loss: the kernel upcasts before any arithmetic.
    value32, grad32, _ = kernel_value_and_grad(logp16.float(), old16.float(), adv, mask, cfg, params)
    assert loss16.item() == pytest.approx(value32.item(), rel=1e-6)
    torch.testing.assert_close(x16.grad.double(), grad32.bfloat16().double())


# --------------------------------------------------------------------------- micro-batch invariance


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_micro_batches_with_global_normalisers_equal_whole_batch(name):
    logp, old, adv, mask = random_batch(12, 17, seed=8, dtype=torch.float32)
    ref = torch.log(torch.rand(12, 17, generator=torch.Generator().manual_seed(9)))
    cfg = LossConfig(name=name, kl_beta=0.1, stats_scope="group", token_budget=BUDGET)
    params = adaptive_params(torch.rand(3, 4), cfg).per_sequence(torch.arange(3).repeat_interleave(4))

    whole = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(whole, old, adv, mask, cfg, params, ref_logp=ref)
    loss.backward()

    split = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (torch.arange(0, 5), torch.arange(5, 6), torch.arange(6, 12)):
        part, _ = policy_loss(
            split[rows], old[rows], adv[rows], mask[rows], cfg, params.per_sequence(rows), ref_logp=ref[rows],
            num_seqs=12, num_tokens=mask.sum(),
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_rows_of_advantage_zero_have_no_gradient_and_can_be_left_out(name, weighted):
    # Why the learner plans them out of its forwards when there is no KL term (apmpo.learner.batching.plan_step):
    # their gradient is exactly 0, and the other rows' loss and gradient are the same without them, given the
    # whole batch's normalisers.
    logp, old, adv, mask = random_batch(12, 17, seed=10, dtype=torch.float32)
    adv[[2, 3, 7]] = 0.0
    weights = torch.rand(12, 17, generator=torch.Generator().manual_seed(11)) * 2 if weighted else None
    cfg = LossConfig(name=name, kl_beta=0.0, stats_scope="group", token_budget=BUDGET)
    params = adaptive_params(torch.rand(3, 4), cfg).per_sequence(torch.arange(3).repeat_interleave(4))

    whole = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(whole, old, adv, mask, cfg, params, token_weights=weights)
    loss.backward()
    assert torch.count_nonzero(whole.grad[[2, 3, 7]]) == 0
    assert torch.count_nonzero(whole.grad) > 0

    kept = torch.tensor([0, 1, 4, 5, 6, 8, 9, 10, 11])
    part = logp[kept].clone().requires_grad_(True)
    loss_kept, _ = policy_loss(part, old[kept], adv[kept], mask[kept], cfg, params.per_sequence(kept), num_seqs=12,
                               num_tokens=mask.sum(), token_weights=None if weights is None else weights[kept])
    loss_kept.backward()
    assert loss_kept.item() == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(part.grad, whole.grad[kept], rtol=1e-5, atol=1e-8)


def test_metrics_are_detached_tensors():
    logp, old, adv, mask = random_batch(4, 6, seed=1, dtype=torch.float32)
    x = logp.clone().requires_grad_(True)
    _, metrics = policy_loss(x, old, adv, mask, LossConfig(), params_for(0.5, 0.3), ref_logp=old)
    expected = {"loss/total", "loss/policy", "loss/kl", "loss/clip_frac_upper", "loss/clip_frac_lower", "policy/ratio_mean",
                "policy/approx_kl", "apmpo/p", "apmpo/eps_ada", "apmpo/fss"}
    assert expected <= metrics.keys()
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_loss_total_is_the_policy_term_plus_beta_kl():
    # loss/policy is the policy term alone; loss/total, the loss returned, adds kl_beta * loss/kl.
    logp, old, adv, mask = random_batch(4, 6, seed=1, dtype=torch.float32)
    ref = old - 0.3 * torch.rand(4, 6, generator=torch.Generator().manual_seed(2))
    cfg, params = LossConfig(kl_beta=0.5), params_for(0.5, 0.3)
    loss, m = policy_loss(logp, old, adv, mask, cfg, params, ref_logp=ref)
    policy_only, m_without = policy_loss(logp, old, adv, mask, cfg, params)
    kl = kl_penalty(logp, ref, mask, cfg)
    assert kl.item() > 0.01  # the KL term is not negligible here
    assert m["loss/total"].item() == loss.item() == pytest.approx(policy_only.item() + 0.5 * kl.item(), rel=1e-6)
    assert m["loss/policy"].item() == policy_only.item()
    assert m["loss/kl"].item() == kl.item()
    assert m_without["loss/total"].item() == m_without["loss/policy"].item() == policy_only.item()


def test_small_p_series_is_exact_to_third_order_in_float64():
    # In fp32 the p^2 k3/6 term is below resolution at |p| < SMALL_P; in fp64 (kept as fp64) it is visible:
    # skewed log x (d up to ~3) gives p^2 k3 / 6 ~ 1e-6 at p = 9e-4, truncation error p^3 k4 / 24 ~ 1e-9.
    log_x = torch.tensor([[-3.0, 0.0, 0.1, 0.2, 0.3]], dtype=torch.float64)
    mask = torch.ones_like(log_x, dtype=torch.bool)
    for p in (0.9 * SMALL_P, -0.9 * SMALL_P):
        got = power_mean(log_x, mask, p)
        assert got.dtype == torch.float64
        want = torch.log(torch.exp(p * log_x).mean()) / p
        assert got.item() == pytest.approx(want.item(), abs=1e-8)


# --------------------------------------------------------------------------- rollout correction: token weights
# w_t = pi_old / pi_engine per token (truncated, or 0 where masked), detached. The reference below applies it
# as the module docstring says, per token in ratio space: on each token's clipped term in GRPO, DAPO and
# Dr. GRPO (w = 0: a zero term, 1/|o_i| unchanged); on x_t = w_t rho'_t inside the power mean of APMPO and
# GMPO, and as the geometric mean of w on GSPO's clipped sequence ratio, both over the kept tokens (w > 0); a
# sequence with none kept contributes 0. Global normalisers (N, all tokens, N * budget) never change.


def reference_weighted(logp, old_logp, adv, mask, w, name, eps_low, eps_high, p=1.0, gmpo_clip=0.4, budget=None):
    """-J with token weights w (nested lists), per token in ratio space, float64."""
    N, T = logp.shape
    per_seq, token_terms, n_tokens = [], [], 0
    for i in range(N):
        A = adv[i]
        toks = [t for t in range(T) if mask[i][t]]
        kept = [t for t in toks if w[i][t] > 0]
        n_tokens += len(toks)
        r = {t: torch.exp(logp[i, t] - old_logp[i, t]) for t in toks}
        if name in ("grpo", "dapo", "dr_grpo"):
            U = [w[i][t] * torch.minimum(r[t] * A, torch.clamp(r[t], 1 - eps_low, 1 + eps_high) * A) for t in toks]
            token_terms += U
            per_seq.append(sum(U) / len(toks))
        elif not kept or A == 0:
            per_seq.append(torch.zeros((), dtype=logp.dtype))
        elif name == "gmpo":
            logs = []
            for t in kept:
                log_r = torch.log(r[t])
                clipped = torch.clamp(log_r, -gmpo_clip, gmpo_clip)
                logs.append((torch.minimum(log_r, clipped) if A > 0 else torch.maximum(log_r, clipped)) + math.log(w[i][t]))
            per_seq.append(A * torch.exp(sum(logs) / len(kept)))
        elif name == "gspo":
            s = torch.exp(sum(torch.log(r[t]) for t in kept) / len(kept))
            g_w = math.exp(sum(math.log(w[i][t]) for t in kept) / len(kept))
            per_seq.append(torch.minimum(s * A, torch.clamp(s, 1 - eps_low, 1 + eps_high) * A) * g_w)
        else:  # apmpo: sgn(A) M_p(|min(r A, rho A)| w) over the kept tokens
            phi = [torch.abs(torch.minimum(r[t] * A, torch.clamp(r[t], 1 - eps_low, 1 + eps_high) * A)) * w[i][t]
                   for t in kept]
            if p == 0:
                M = torch.exp(sum(torch.log(x) for x in phi) / len(phi))
            else:
                M = (sum(x**p for x in phi) / len(phi)) ** (1 / p)
            per_seq.append(math.copysign(1.0, A) * M)
    if name == "dapo":
        return -sum(token_terms) / n_tokens
    if name == "dr_grpo":
        return -sum(token_terms) / (N * budget)
    return -sum(per_seq) / N


def random_token_weights(N, T, seed):
    """Positive weights around 1, about a fifth of them 0 (masked), and row 1 masked entirely."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(N, T, generator=g, dtype=torch.float64) * 0.5).clamp(max=1.6)
    w[torch.rand(N, T, generator=g) < 0.2] = 0.0
    w[1] = 0.0
    return w


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name,p", [("apmpo", 0.7), ("apmpo", 1.0), ("apmpo", 0.0), ("apmpo", -0.5), ("apmpo", 2.5),
                                    ("grpo", None), ("dapo", None), ("dr_grpo", None), ("gmpo", None), ("gspo", None)])
def test_token_weights_match_per_token_reference(seed, name, p):
    N, T = 7, 11
    logp, old, adv, mask = random_batch(N, T, 400 + seed)
    w = random_token_weights(N, T, 500 + seed)
    assert ((w > 0) & mask).any(-1).sum() >= 3  # some rows keep tokens, row 1 none
    if name == "apmpo":  # the reference gets p and eps_ada as the kernel does, rounded to fp32 by params_for
        cfg, params = LossConfig(), params_for(p, 0.33)
        kw = dict(eps_low=0.2, eps_high=params.eps_ada.item(), p=params.p.item())
    elif name == "gspo":  # a wider clip than GSPO's, so some sequences are clipped and some are not
        cfg = LossConfig(name=name, eps_low=0.05, eps_high=0.06)
        params, kw = params_for(0.0, 0.06), dict(eps_low=0.05, eps_high=0.06)
    else:
        cfg = LossConfig(name=name, token_budget=BUDGET)
        params, kw = params_for(1.0, cfg.eps_high), dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, budget=BUDGET)
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask, cfg, params, token_weights=w)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    ref = reference_weighted(y, old, adv.tolist(), mask.tolist(), w.tolist(), name, **kw)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(x.grad[1], torch.zeros(T, dtype=x.dtype))  # a fully masked sequence: no policy term
    # The weights are detached: a weight tensor that requires grad gets none.
    w_grad = w.clone().requires_grad_(True)
    policy_loss(logp.clone().requires_grad_(True), old, adv, mask, cfg, params, token_weights=w_grad)[0].backward()
    assert w_grad.grad is None


def test_hand_token_weights():
    # Two tokens with r = 1 (logp = old), A = 1, weights w = [4, 1], except where said.
    logp, old = torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    mask, adv, w = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, dtype=torch.float64), torch.tensor([[4.0, 1.0]])

    def run(name, weights, p=1.0):
        x = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, old, adv, mask, LossConfig(name=name, token_budget=4), params_for(p, 0.3),
                              token_weights=weights.double())
        loss.backward()
        return loss.item(), x.grad[0].tolist()

    # GRPO: mean_t w_t rho'_t A = (4 + 1)/2 = 2.5; d/dl_t = w_t r_t / 2 = [2, 0.5] (r = 1 is inside the clip)
    assert run("grpo", w) == (pytest.approx(-2.5), pytest.approx([-2.0, -0.5]))
    # masked first token: (0 + 1)/2 = 0.5, still divided by |o| = 2
    assert run("grpo", torch.tensor([[0.0, 1.0]])) == (pytest.approx(-0.5), pytest.approx([0.0, -0.5]))
    # DAPO: (4 + 1) / 2 tokens = 2.5; Dr. GRPO: (4 + 1) / (1 sequence * budget 4) = 1.25
    assert run("dapo", w)[0] == pytest.approx(-2.5)
    assert run("dr_grpo", w)[0] == pytest.approx(-1.25)
    # APMPO p = 0.5: M = ((sqrt 4 + sqrt 1)/2)^2 = 1.5^2 = 2.25; d log M / d l_t = x_t^p / sum x^p = [2/3, 1/3],
    # so dM/dl = 2.25 * [2/3, 1/3] = [1.5, 0.75]
    assert run("apmpo", w, p=0.5) == (pytest.approx(-2.25), pytest.approx([-1.5, -0.75]))
    # APMPO p = 0 and GMPO: geometric mean exp((ln 4 + 0)/2) = 2; d/dl_t = 2 * [1/2, 1/2] = [1, 1]
    assert run("apmpo", w, p=0.0) == (pytest.approx(-2.0), pytest.approx([-1.0, -1.0]))
    assert run("gmpo", w) == (pytest.approx(-2.0), pytest.approx([-1.0, -1.0]))
    # masked first token in a power mean: it leaves the mean, which is x_2 = 1 (p = 0.5 and p = -2 alike)
    for p in (0.5, -2.0):
        assert run("apmpo", torch.tensor([[0.0, 1.0]]), p=p) == (pytest.approx(-1.0), pytest.approx([0.0, -1.0]))
    assert run("gmpo", torch.tensor([[0.0, 0.0]])) == (0.0, [0.0, 0.0])  # nothing kept: no policy term
    # GSPO: s = 1 (unclipped), times the geometric mean of w, 2: -2.0; d/dl_t = 2 * s / 2 = [1, 1]
    assert run("gspo", w) == (pytest.approx(-2.0), pytest.approx([-1.0, -1.0]))


def test_token_weights_p1_is_decoupled_grpo_and_p0_the_sequence_weight():
    # APMPO at p = 1 with token weights is GRPO's token-level decoupled loss (same clip); at p = 0, with no token
    # masked, it is the unweighted p = 0 loss with each advantage times the geometric mean of its weights.
    logp, old, adv, mask = random_batch(6, 9, seed=11)
    w = torch.exp(torch.randn(6, 9, generator=torch.Generator().manual_seed(12), dtype=torch.float64) * 0.4)
    apmpo = LossConfig(fac=False, eps_high=0.25)
    grpo = LossConfig(name="grpo", eps_high=0.25)
    a = policy_loss(logp, old, adv, mask, apmpo, params_for(1.0, 0.25), token_weights=w)[0]
    b = policy_loss(logp, old, adv, mask, grpo, params_for(1.0, 0.25), token_weights=w)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    g = torch.exp((torch.log(w) * mask).sum(-1) / mask.sum(-1))
    c = policy_loss(logp, old, adv, mask, apmpo, params_for(0.0, 0.25), token_weights=w)[0]
    d = policy_loss(logp, old, adv * g, mask, apmpo, params_for(0.0, 0.25))[0]
    assert c.item() == pytest.approx(d.item(), rel=1e-12)


BASELINE = "53e5db379cd0b37eaff44009560415de1536a08c"  # apmpo/loss.py before rollout correction


def baseline_loss_module():
    """apmpo/loss.py as it was before token weights, read from git (skipped outside a git checkout)."""
    import subprocess
    import sys
    import types
    from pathlib import Path

    try:
        source = subprocess.run(["git", "show", f"{BASELINE}:apmpo/loss.py"], capture_output=True, text=True,
                                check=True, cwd=Path(__file__).parent).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs the git history (commit {BASELINE[:8]})")
    module = types.ModuleType("apmpo_loss_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is created
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_without_token_weights_every_loss_is_bit_identical_to_before(name):
    # Correction off (and sequence level, which only scales the advantages) leaves each loss's code path as it
    # was: loss, gradient and metrics equal the pre-correction module's bit for bit, micro-batch normalisers on.
    old_module = baseline_loss_module()
    logp, old, adv, mask = random_batch(9, 13, seed=21, dtype=torch.float32)
    ref = old - 0.2
    results = []
    for module in (old_module, None):
        loss_config = (old_module.LossConfig if module else LossConfig)(name=name, token_budget=BUDGET, kl_beta=0.1,
                                                                        stats_scope="group")
        params = (old_module.adaptive_params if module else adaptive_params)(
            torch.rand(3, 3, generator=torch.Generator().manual_seed(3)), loss_config).per_sequence(
            torch.arange(3).repeat_interleave(3))
        x = logp.clone().requires_grad_(True)
        fn = module.policy_loss if module else policy_loss
        loss, metrics = fn(x, old, adv, mask, loss_config, params, ref_logp=ref, num_seqs=12, num_tokens=90)
        loss.backward()
        results.append((loss, x.grad, metrics))
    (loss0, grad0, m0), (loss1, grad1, m1) = results
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_token_weights_micro_batches_with_global_normalisers_equal_whole_batch(name):
    logp, old, adv, mask = random_batch(12, 17, seed=8, dtype=torch.float32)
    w = random_token_weights(12, 17, seed=9).float()
    cfg, params = LossConfig(name=name, token_budget=BUDGET), params_for(0.6, 0.3)
    whole = logp.clone().requires_grad_(True)
    policy_loss(whole, old, adv, mask, cfg, params, token_weights=w)[0].backward()
    split = logp.clone().requires_grad_(True)
    for rows in (torch.arange(0, 5), torch.arange(5, 6), torch.arange(6, 12)):
        policy_loss(split[rows], old[rows], adv[rows], mask[rows], cfg, params, num_seqs=12, num_tokens=mask.sum(),
                    token_weights=w[rows])[0].backward()
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-5, atol=1e-8)


class _HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each blocking copy of a host tensor to another device: on a GPU each one makes the host wait for
    every kernel queued before it."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        source = args[1] if func is torch.ops.aten.copy_.default else args[0]
        blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default) and blocking:
            target = args[0].device if func is torch.ops.aten.copy_.default else out.device
            if source.device.type == "cpu" and target.type != "cpu":
                self.copies.append(str(func))
        return out


@pytest.mark.parametrize("scope", ["batch", "group"])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_no_loss_makes_a_blocking_copy_from_the_host(name, scope):
    """The step's p and eps come from rewards on the CPU; logp lives on the accelerator (here the meta device,
    where such copies dispatch as they do to CUDA). On an H200 APMPO made 4 host syncs per call this way, and
    every loss 2 more through torch.as_tensor(float, device=...) in clip_bounds, whose copy a dispatch mode
    does not see (torch.cuda.set_sync_debug_mode found those; now none)."""
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(4, 4, generator=g) > 0.5).float()
    cfg = LossConfig(name=name, stats_scope=scope, token_budget=16)
    params = adaptive_params(rewards, cfg).per_sequence(torch.arange(16) // 4)
    advantages = advantages_for(rewards, cfg).flatten().to("meta")
    logp = torch.empty(16, 8, device="meta", requires_grad=True)
    old, mask = torch.empty(16, 8, device="meta"), torch.ones(16, 8, dtype=torch.bool, device="meta")
    with _HostCopies() as mode:
        loss, _ = policy_loss(logp, old, advantages, mask, cfg, params)
        loss.backward()
    assert mode.copies == []
