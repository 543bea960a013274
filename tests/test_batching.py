"""The step plan: every sequence trained once per optimiser step, ranks balanced, budgets kept."""
import pytest
import torch

from apmpo.trajectory import Rollout
from apmpo.learner.batching import collate, equalize, plan_step, shard_by_tokens, split_by_budget


def rollouts(lengths, group_size=4):
    return [Rollout([1] * 3, [2] * n, [0.0] * n, "stop", group=i // group_size) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("budget", [16, 64, 10_000])
def test_plan_covers_every_sequence_once_with_equal_micro_batch_counts(world_size, budget):
    batch = rollouts([(7 * i) % 23 + 1 for i in range(32)])
    plan = plan_step(batch, num_steps=4, world_size=world_size, token_budget=budget, seed=0)
    assert len(plan) == 4
    seen = []
    for step in plan:
        assert len({len(rank) for rank in step.micro}) == 1  # same number of micro-batches on every rank
        step_indices = [i for rank in step.micro for micro in rank for i in micro]
        assert sorted(step.indices) == sorted(step_indices)
        assert len({batch[i].group for i in step_indices}) == 2  # whole groups: 8 groups over 4 steps
        assert step.num_seqs == 8 and step.num_tokens == sum(len(batch[i].completion_ids) for i in step_indices)
        seen += step_indices
        for rank in step.micro:
            for micro in rank:
                if len(micro) > 1:
                    assert len(micro) * max(batch[i].num_tokens for i in micro) <= budget
    assert sorted(seen) == list(range(32))


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_of_advantage_zero_get_no_micro_batch_but_count_in_the_normalisers(world_size):
    batch = rollouts([(5 * i) % 13 + 1 for i in range(16)])
    for r in batch:
        r.advantage = 0.0 if r.group in (1, 2) else 1.0
    full = plan_step(batch, num_steps=2, world_size=world_size, token_budget=64, seed=0)
    skipped = plan_step(batch, num_steps=2, world_size=world_size, token_budget=64, seed=0, skip_zero_advantage=True)
    for a, b in zip(full, skipped):
        assert (a.num_seqs, a.num_tokens) == (b.num_seqs, b.num_tokens) == (8, a.num_tokens)
        assert sorted(b.indices) == [i for i in sorted(a.indices) if batch[i].group not in (1, 2)]
    # An optimiser step with no row left runs one zero-weight dummy micro-batch on each rank: Adam still steps.
    for r in batch:
        r.advantage = 0.0
    for step in plan_step(batch, num_steps=2, world_size=world_size, token_budget=64, seed=0,
                          skip_zero_advantage=True):
        assert step.micro == [[[]]] * world_size and step.num_seqs == 8


def test_empty_batch_plans_no_step():
    assert plan_step([], num_steps=2, world_size=2, token_budget=64, seed=0) == []


def test_shards_are_balanced_by_tokens():
    lengths = [50, 40, 30, 20, 10, 10, 10, 10]
    shards = shard_by_tokens(list(range(8)), lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert loads == [90, 90]


def test_split_and_equalize():
    assert split_by_budget([0, 1, 2], [5, 5, 5], 10) == [[0, 1], [2]]
    assert split_by_budget([0], [50], 10) == [[0]]  # too long alone: its own micro-batch
    # Splits the largest (the first of equals) in halves, appended at the end, until there are 3:
    # [[0, 1, 2, 3]] -> [[0, 1], [2, 3]] -> [0, 1] is the first of two of length 2 -> [[2, 3], [0], [1]].
    assert equalize([[0, 1, 2, 3]], 3) == [[2, 3], [0], [1]]
    # [[0, 1, 2], [3, 4, 5, 6, 7]] -> [3..7] splits into [3, 4] and [5, 6, 7] -> [[0, 1, 2], [3, 4], [5, 6, 7]].
    assert equalize([[0, 1, 2], [3, 4, 5, 6, 7]], 3) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert equalize([[0]], 3) == [[0], [], []]  # empty ones become zero-weight dummies


def _every_split(rows: list[int]):
    """Every way to cut `rows` into contiguous micro-batches (the naive reference: 2^(n-1) of them)."""
    if not rows:
        yield []
        return
    for k in range(1, len(rows) + 1):
        for rest in _every_split(rows[k:]):
            yield [rows[:k], *rest]


@pytest.mark.parametrize("seed", range(20))
def test_split_by_budget_is_the_cheapest_split_within_the_budget(seed):
    """Against every contiguous cut of the rows sorted by length: the split keeps the budget and costs least
    (padded tokens + the overhead per micro-batch); a row over the budget is alone."""
    import random

    rng = random.Random(seed)
    n, overhead, budget = rng.randint(1, 10), rng.choice([0, 3, 16, 64]), rng.choice([8, 20, 40, 1000])
    lengths = [rng.randint(1, 30) for _ in range(n)]
    indices = rng.sample(range(n), n)

    def cost(split):
        return sum(len(m) * max(lengths[i] for i in m) + overhead for m in split)

    def fits(split):
        return all(len(m) == 1 or len(m) * max(lengths[i] for i in m) <= budget for m in split)

    got = split_by_budget(indices, lengths, budget, overhead_tokens=overhead)
    assert sorted(i for m in got for i in m) == sorted(indices) and fits(got)
    assert [lengths[i] for m in got for i in m] == sorted(lengths)  # similar lengths together
    by_length = sorted(indices, key=lambda i: lengths[i])
    assert cost(got) == min(cost(split) for split in _every_split(by_length) if fits(split))


def test_split_by_budget_trades_padding_for_micro_batches():
    # Rows of 1 and 100 tokens: together they pad to 2 x 100; apart they pay the overhead twice.
    assert split_by_budget([0, 1], [1, 100], 1000, overhead_tokens=10) == [[0], [1]]  # 1 + 10 + 100 + 10 < 200 + 10
    assert split_by_budget([0, 1], [1, 100], 1000, overhead_tokens=200) == [[0, 1]]  # 200 + 200 < 1 + 100 + 400


def test_collate_masks_completions_and_dummy_weight():
    batch = [Rollout([5, 6], [7, 8, 9], [0.0] * 3, "stop", group=0, advantage=1.5),
             Rollout([5], [7], [0.0], "length", group=0, advantage=-1.5)]
    mb = collate(batch, [0, 1], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.advantages.tolist() == [1.5, -1.5] and mb.weight == 1.0
    assert collate(batch, [], pad_id=0).weight == 0.0


def test_overlong_penalty_is_dapos_soft_punishment():
    from apmpo.config import RolloutConfig
    from apmpo.learner.collect import overlong_penalty

    cfg = RolloutConfig(max_tokens=100, overlong_buffer=20, overlong_penalty=1.0)
    # no penalty up to 100 - 20 = 80 tokens, then linear: 90 -> -(10/20) = -0.5, 100 -> -1
    assert [overlong_penalty(n, cfg) for n in (10, 80, 81, 90, 100)] == [0.0, 0.0, -0.05, -0.5, -1.0]
    assert overlong_penalty(100, RolloutConfig(max_tokens=100)) == 0.0  # buffer 0: off


def test_prompt_sampler_is_seeded_covers_each_epoch_and_resumes():
    from apmpo.learner.collect import PromptSampler

    a = PromptSampler(10, seed=3)
    first = a.take(4) + a.take(6)
    assert sorted(first) == list(range(10))  # one epoch = every prompt once
    second_epoch = a.take(10)
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first
    resumed = PromptSampler(10, seed=3, **PromptSampler(10, seed=3, epoch=0, position=4).state_dict())
    assert resumed.take(6) == first[4:]


def packed_size(rows):
    """The tokens the packed forward computes for a micro-batch of `rows` (apmpo.learner.logprobs): each group's
    prompt once, then its completions' inputs (all but the last token) packed into rows as wide as the longest,
    each row as long as the longest prompt plus that width."""
    from apmpo.learner.logprobs import pack

    groups = {}
    for r in rows:
        groups.setdefault(r.group, []).append(max(len(r.completion_ids) - 1, 0))
    longest, width = max(len(r.prompt_ids) for r in rows), max(max(i) for i in groups.values())
    packed_rows = sum(len(pack(inputs, [0] * len(inputs), width)[0]) for inputs in groups.values()) if width else 0
    return len(groups) * longest + packed_rows * (longest + width)


def test_packed_plan_keeps_groups_whole_within_the_budget_of_what_packing_computes():
    from apmpo.learner.batching import split_packed

    g = torch.Generator().manual_seed(0)
    batch = []
    for group in range(12):
        prompt = torch.randint(3, 50, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(1, 30, (1,), generator=g))
            batch.append(Rollout(prompt, [7] * n, [0.0] * n, "stop", group=group))
    batch += [Rollout([5] * 4, [7] * 200, [0.0] * 200, "stop", group=12) for _ in range(4)]  # over the budget alone
    # packed_size by hand: one group, prompt of 3, completions of 5, 2, 2, 1 tokens -> inputs 4, 1, 1, 0, width 4:
    # rows [4] and [1, 1]; 3 prompt tokens once, then 2 rows of 3 + 4.
    hand = [Rollout([1, 2, 3], [7] * n, [0.0] * n, "stop", group=0) for n in (5, 2, 2, 1)]
    assert packed_size(hand) == 3 + 2 * (3 + 4)
    budget = 300
    micro = split_packed(list(range(len(batch))), batch, budget)
    assert sorted(i for m in micro for i in m) == list(range(len(batch)))
    oversize = {r.group for r in batch if packed_size([x for x in batch if x.group == r.group]) > budget}
    assert oversize == {12} and any(len({batch[i].group for i in m}) > 1 for m in micro)
    for m in micro:
        groups = {batch[i].group for i in m}
        if groups & oversize:  # cut by split_by_budget: within the padded budget
            assert groups <= oversize and len(m) * max(batch[i].num_tokens for i in m) <= budget
        else:  # whole groups, within the budget
            assert all(sum(batch[i].group == k for i in m) == 4 for k in groups)
            assert packed_size([batch[i] for i in m]) <= budget
