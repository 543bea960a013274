"""collect_rollouts, rank 0's half of a step, without a server: DAPO's switches (dynamic sampling, overlong shaping,
masking of truncated completions) and rewards that fail. The samples come from tests/fakes.py's FakeServer (a
fake: the checks need to know each sample's correctness and length in advance); the rewards run in the real
RewardPool, with the quickstart's reward and the failing ones of tests/failing_rewards.py."""
import logging
import math
import time

import pytest

import failing_rewards
from apmpo.config import load_config
from apmpo.learner.collect import PromptSampler, collect_rollouts
from apmpo.rewards import RewardPool, get_reward
from fakes import FakeServer

B, G = 4, 4
RECORDS = [{"task": "quickstart", "answer": "123", "id": i} for i in range(16)]
PROMPTS = {(i,): record for i, record in enumerate(RECORDS)}


def collect(reward="quickstart", fake=None, overrides=(), step=1, timeout_s=1.0):
    """One step's batch from the fake server, scored in a one-worker pool."""
    cfg = load_config(None, [f"rollout.prompts_per_step={B}", f"rollout.group_size={G}", f"train.mini_batch_size={B}",
                             "rollout.max_tokens=4", "data.max_prompt_tokens=64", *overrides])
    fake = fake or FakeServer(None, RECORDS, right=lambda record: "1", prompts=PROMPTS)
    sampler = PromptSampler(len(RECORDS), seed=0)
    with RewardPool(1, timeout_s) as pool:
        fn = get_reward(reward) if isinstance(reward, str) else reward
        batch = collect_rollouts(
            fake, sampler, [[i] for i in range(len(RECORDS))], RECORDS,
            lambda completions, samples, **limits: pool.score(fn, completions, samples, **limits),
            cfg.rollout, cfg.loss, run_seed=0, step=step, sampling=cfg.rollout.sampling([2]))
    return batch, fake


def informative_if_odd(record, draw):
    """Even ids answer right every time (a group of equal rewards, which dynamic sampling drops); odd ids every
    third draw."""
    return record["id"] % 2 == 0 or draw % 3 == 0


def test_dynamic_sampling_keeps_informative_groups_until_the_batch_is_full():
    fake = FakeServer(None, RECORDS, right=lambda record: "1", correct=informative_if_odd, prompts=PROMPTS)
    batch, _ = collect(fake=fake, overrides=["loss.name=dapo", "rollout.dynamic_sampling=true",
                                             "rollout.max_sampling_rounds=3"])
    # The rounds the batch needs: the same seeded prompt order, B prompts a round, until B odd ids are found.
    order, found, rounds = PromptSampler(len(RECORDS), seed=0), 0, 0
    while found < B and rounds < 3:
        found += sum(i % 2 for i in order.take(B))
        rounds += 1
    m = batch.metrics
    assert (m["rollout/rounds"], m["rollout/groups"], m["rollout/informative_groups_frac"]) == (rounds, B, 1.0)
    assert len(fake.requests) == rounds
    assert all(request["prompts"] == B and request["n"] == G for request in fake.requests)
    assert len(batch.rollouts) == B * G and batch.rewards.shape == (B, G)
    assert all(len(set(row.tolist())) > 1 for row in batch.rewards)  # every kept group is informative
    assert len({r.group for r in batch.rollouts}) == B


def test_dynamic_sampling_with_nothing_informative_trains_the_last_round():
    fake = FakeServer(None, RECORDS, right=lambda record: "1", correct=lambda record, draw: True, prompts=PROMPTS)
    batch, _ = collect(fake=fake, overrides=["loss.name=dapo", "rollout.dynamic_sampling=true",
                                             "rollout.max_sampling_rounds=3"])
    m = batch.metrics
    assert (m["rollout/rounds"], m["rollout/groups"], m["rollout/informative_groups_frac"]) == (3, B, 0.0)
    assert len(fake.requests) == 3 and batch.rewards.eq(1.0).all()
    assert all(r.advantage == 0.0 for r in batch.rollouts)


def test_without_dynamic_sampling_every_group_is_trained_in_one_round():
    fake = FakeServer(None, RECORDS, right=lambda record: "1", correct=informative_if_odd, prompts=PROMPTS)
    batch, _ = collect(fake=fake, overrides=["loss.name=dapo"])
    m = batch.metrics
    assert (m["rollout/rounds"], m["rollout/groups"], len(fake.requests)) == (1, B, 1)
    informative = sum(len(set(row.tolist())) > 1 for row in batch.rewards)
    assert m["rollout/informative_groups_frac"] == informative / B


def test_overlong_penalty_reaches_the_trained_rewards():
    """DAPO's overlong shaping, exactly. With the buffer as long as max_tokens (4) every completion is in the
    linear part: penalty(n) = -0.5 * min(1, (n - (4 - 4)) / 4) = -n / 8 for n = 1..4 tokens. Every group is trained
    (no dynamic sampling), so over the same B x G completions: trained mean = reward/mean - response/length_mean / 8."""
    fake = FakeServer(None, RECORDS, right=lambda record: "1", length=lambda draw: 1 + draw % 4, prompts=PROMPTS)
    batch, _ = collect(fake=fake, overrides=["loss.name=dapo", "rollout.overlong_buffer=4",
                                             "rollout.overlong_penalty=0.5"])
    seed = fake.requests[0]["seed"]
    for k, rollout in enumerate(batch.rollouts):  # no masking: the rollouts are the draws, in order
        n, raw = 1 + (seed + k) % 4, float((seed + k) % 3 == 0)  # the fake's length and correctness of draw k
        assert (len(rollout.completion_ids), rollout.reward) == (n, pytest.approx(raw - n / 8, abs=1e-12)), k
    assert {len(r.completion_ids) for r in batch.rollouts} == {1, 2, 3, 4}  # every point of the slope is checked
    m = batch.metrics
    assert m["response/length_mean"] > 1
    assert m["reward/trained_mean"] == pytest.approx(m["reward/mean"] - m["response/length_mean"] / 8, abs=1e-6)


def test_mask_truncated_drops_completions_that_hit_max_tokens():
    fake = FakeServer(None, RECORDS, right=lambda record: "1", length=lambda draw: 1 + draw % 4, prompts=PROMPTS)
    batch, fake = collect(fake=fake, overrides=["loss.name=dapo", "rollout.mask_truncated=true"])
    seed = fake.requests[0]["seed"]
    truncated = sum((seed + k) % 4 == 3 for k in range(B * G))  # length 4 = max_tokens: finish "length"
    assert truncated > 0
    assert len(batch.rollouts) == B * G - truncated
    assert all(r.finish_reason == "stop" for r in batch.rollouts)
    assert batch.metrics["response/truncated_frac"] == truncated / (B * G)
    assert batch.metrics["rollout/trained_sequences"] == B * G - truncated


def test_nan_rewards_score_zero_are_counted_logged_once_and_the_batch_is_finite(caplog):
    """Before: reward/mean was NaN every step and reward/failures 0. Wrong answers are "xxxx", whose bytes sum to
    480 = 0 mod 20: nan_every_20th returns NaN for exactly those, every third draw."""
    fake = FakeServer(None, RECORDS, right=lambda record: "1", wrong="xxxx", correct=lambda record, draw: draw % 3 != 0,
                      prompts=PROMPTS)
    with caplog.at_level(logging.WARNING):
        batch, _ = collect(reward=failing_rewards.nan_every_20th, fake=fake)
    seed = fake.requests[0]["seed"]
    expected = sum((seed + k) % 3 == 0 for k in range(B * G))
    assert 0 < batch.metrics["reward/failures"] == expected
    assert batch.rewards.flatten().tolist() == [float((seed + k) % 3 != 0) for k in range(B * G)]
    assert math.isfinite(batch.metrics["reward/mean"]) and math.isfinite(batch.metrics["reward/std"])
    assert caplog.text.count("the reward returned nan, not a finite float32 number") == 1


def test_a_reward_that_always_crashes_stops_the_step_naming_the_error():
    with pytest.raises(RuntimeError) as error:
        collect(reward=failing_rewards.always_exit)
    assert str(error.value) == (
        f"reward scoring failed for {B * G} of {B * G} completions this step (errors, crashes, time-outs past "
        "rollout.reward_timeout_s or rollout.reward_step_timeout_s); the first: worker exited with code 3. The "
        "reward function looks broken: stopping rather than training on zeros")


def test_a_reward_that_always_hangs_stops_at_the_step_time_limit():
    """16 hanging items on 1 worker at 60 s each would take 16 minutes; the step's limit ends scoring at 2 s."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"reward scoring failed for {B * G} of {B * G} completions"):
        collect(reward=failing_rewards.hang, timeout_s=60.0, overrides=["rollout.reward_step_timeout_s=2"])
    assert time.monotonic() - start < 15
