"""From a rollout batch to what each rank feeds the model: mini-batches, rank shards, micro-batches.

Every rank receives the whole rollout batch from rank 0 and computes the same plan from it, so the plan
needs no communication:

1. mini-batches: the step's prompts (groups), permuted with a seed, split into optimiser steps;
2. rank shards: each mini-batch's sequences dealt to the data-parallel ranks, balanced by token count
   (longest first, to the rank with the fewest tokens so far);
3. micro-batches: each shard, sorted by length, cut where padding and micro-batches cost least within a token
   budget (padded length x rows); or, for a model whose log-probs pack the completions of a prompt into shared
   rows (apmpo.learner.logprobs), whole groups in order within the budget of what packing computes. Every rank
   gets the same number of micro-batches per optimiser step, because ZeRO's gradient reduction is collective: a
   rank with fewer sequences gets empty micro-batches, run as zero-weight dummies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from apmpo.learner.logprobs import pack
from apmpo.loss import AdaptiveParams
from apmpo.trajectory import Rollout

# What one more micro-batch costs, in padded tokens: in the quickstart model's log-probs and update (reference
# forward, forward, backward), 128 rows of 54 tokens took 0.147 s in one micro-batch, 0.177 s in four and 0.264 s
# in eight: 10-20 ms each, 500-900 tokens at the 21 us a token costs. Below this, fewer padded tokens are not worth
# another micro-batch; the budget still bounds memory.
MICRO_BATCH_OVERHEAD_TOKENS = 512


@dataclass
class StepRollouts:
    """Rank 0's rollout batch of one training step (apmpo.learner.collect.collect_rollouts)."""

    rollouts: list[Rollout]  # what the learner trains on, advantages filled in
    rewards: Tensor  # [groups, G] rewards of the trained groups
    params: AdaptiveParams  # APMPO's p, FSS and eps_ada, from `rewards` as the advantages are
    metrics: dict[str, float]
    times: dict[str, float]  # seconds: "generate", "reward" ("env" for episodes); the driver names them as logged
    weight_version: int  # the oldest server weights that generated any of it (asynchronous training's staleness)
    sampler_before: dict  # the prompt sampler's state before this batch: a resume regenerates it from there

    def staleness(self, policy_version: int) -> int:
        """How many weight pushes lie between the weights that generated this batch (its oldest request's) and
        `policy_version`, the policy it trains."""
        return policy_version - self.weight_version


@dataclass
class MicroBatch:
    """Padded tensors of a few rollouts. Shapes: [n, L], L = longest prompt + completion in it."""

    indices: list[int]  # rollout indices in the step's batch
    input_ids: Tensor  # prompt then completion, right-padded
    attention_mask: Tensor  # 1 on real tokens
    loss_mask: Tensor  # True at sampled completion tokens: the positions scored and trained
    advantages: Tensor  # [n]
    engine_logp: Tensor  # [n, L] the generation engine's log-probs of the completion tokens, 0 elsewhere
    weight: float = 1.0  # 0 for the dummy micro-batches that keep ranks in step
    old_logp: Tensor | None = None  # [n, L] filled by the learner before the first update
    ref_logp: Tensor | None = None
    # Forward inputs beyond ids and mask, for vision-language models: pixel_values [sum P, D] and image_grid_thw
    # [sum I, 3] of the rows' images in row order, mm_token_type_ids [n, L] (1 at image tokens, 0 elsewhere).
    extras: dict[str, Tensor] = field(default_factory=dict)


def mini_batches(num_groups: int, num_steps: int, seed: int) -> list[list[int]]:
    """The step's groups in a seeded random order, split into `num_steps` nearly equal optimiser steps."""
    order = torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed)).tolist()
    num_steps = min(num_steps, num_groups)
    return [chunk.tolist() for chunk in torch.tensor(order).tensor_split(num_steps)]


def shard_by_tokens(indices: list[int], lengths: list[int], world_size: int) -> list[list[int]]:
    """Deal sequences to ranks so each gets about the same number of tokens (greedy, longest first)."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(indices, key=lambda i: -lengths[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], len(shards[r])))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return shards


def split_by_budget(indices: list[int], lengths: list[int], token_budget: int,
                    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS) -> list[list[int]]:
    """Cut a shard into micro-batches whose padded size (rows x longest row) stays within the budget, with the
    least padding: the rows sorted by length, cut where the padded tokens, plus `overhead_tokens` for each
    micro-batch, add up to the least (a dynamic programme over the cut points). Filling each micro-batch up to the
    budget instead took 1.12x the time of the learner's step on 128 quickstart-model rows, a fifth of them with 64
    completion tokens and the rest 1-40; on completions of geometric lengths (mean 32) the two came out the same.
    A single sequence longer than the budget gets a micro-batch of its own."""
    order = sorted(indices, key=lambda i: lengths[i])
    least = [0] + [None] * len(order)  # least[j]: the least cost of the j shortest rows; they end a micro-batch
    cut = [0] * (len(order) + 1)  # where the micro-batch that ends at row j starts
    for j in range(1, len(order) + 1):
        longest = lengths[order[j - 1]]
        for i in range(j - 1, -1, -1):  # the micro-batch order[i:j], longer and longer
            if i < j - 1 and (j - i) * longest > token_budget:
                break
            cost = least[i] + (j - i) * longest + overhead_tokens
            if least[j] is None or cost < least[j]:
                least[j], cut[j] = cost, i
    micro, j = [], len(order)
    while j > 0:
        micro.append(order[cut[j]:j])
        j = cut[j]
    return micro[::-1]


def _inputs(rows: list[Rollout]) -> list[int]:
    return [max(len(r.completion_ids) - 1, 0) for r in rows]  # the last token predicts nothing


def _packed_rows(inputs: list[int], width: int) -> int:
    """The rows that one prompt's completions (their `inputs` tokens) pack into at `width` (logprobs.pack)."""
    return len(pack(inputs, [0] * len(inputs), width)[0]) if width else 0


def _size(groups: int, longest_prompt: int, width: int, packed_rows: int) -> int:
    """The tokens a micro-batch computes when the rows of a prompt share it and pack their completions
    (apmpo.learner.logprobs): each group's prompt once, then packed rows as long as the longest prompt (their
    cache) plus the longest completion. Groups with the same prompt, which the forward merges, are counted apart:
    never less than it computes."""
    return groups * longest_prompt + packed_rows * (longest_prompt + width)


def split_packed(indices: list[int], rollouts: list[Rollout], token_budget: int) -> list[list[int]]:
    """Micro-batches for packed log-probs: whole groups in order (the completions of a group pack together), each
    micro-batch taking the next group while its packed size (_size) stays within the budget (kept as it grows: a group's
    packed rows are counted again only when the micro-batch's width grows). The rows of groups over the budget on
    their own are cut together as split_by_budget cuts them. On the quickstart's 64-token batches one micro-batch
    instead of three sorted by length: the learner's step (reference forward, forward, backward) took 0.10-0.11 s
    instead of 0.15-0.16 (its budget raised to 16384 tokens for both)."""
    by_group: dict[int, list[int]] = {}
    for i in indices:
        by_group.setdefault(rollouts[i].group, []).append(i)
    micro: list[list[int]] = []
    over: list[int] = []  # the rows of groups over the budget on their own
    # The micro-batch being filled: its rows, its groups' inputs, and the terms of its _size.
    rows: list[int] = []
    group_inputs: list[list[int]] = []
    longest = width = packed = 0
    for members in by_group.values():
        inputs = _inputs([rollouts[i] for i in members])
        prompt = max(len(rollouts[i].prompt_ids) for i in members)
        wider = max(width, max(inputs))
        packed_with = (packed if wider == width else sum(_packed_rows(i, wider) for i in group_inputs)) \
            + _packed_rows(inputs, wider)
        if _size(len(group_inputs) + 1, max(longest, prompt), wider, packed_with) <= token_budget:
            rows += members
            group_inputs.append(inputs)
            longest, width, packed = max(longest, prompt), wider, packed_with
            continue
        if rows:
            micro.append(rows)
        rows, group_inputs, longest, width, packed = [], [], 0, 0, 0
        alone = _packed_rows(inputs, max(inputs))
        if _size(1, prompt, max(inputs), alone) <= token_budget:
            rows, group_inputs, longest, width, packed = list(members), [inputs], prompt, max(inputs), alone
        else:
            over += members
    if rows:
        micro.append(rows)
    return micro + (split_by_budget(over, [r.num_tokens for r in rollouts], token_budget) if over else [])


def equalize(micro: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count`; pad with empty ones (zero-weight dummies)."""
    micro = [list(m) for m in micro]
    while len(micro) < count:
        largest = max(range(len(micro)), key=lambda k: len(micro[k]), default=None)
        if largest is None or len(micro[largest]) < 2:
            micro.append([])
            continue
        m = micro.pop(largest)
        micro += [m[: len(m) // 2], m[len(m) // 2 :]]
    return micro


@dataclass(frozen=True)
class OptimizerStep:
    """One optimiser step of a training step's plan."""

    micro: list[list[list[int]]]  # micro[rank][k]: rollout indices of that rank's k-th micro-batch ([]: a dummy)
    num_seqs: int  # sequences in this optimiser step, all ranks together: the loss's global normalisers
    num_tokens: int  # sampled completion tokens in it, all ranks together (the loss's tokens)

    @property
    def indices(self) -> list[int]:
        return [i for rank in self.micro for batch in rank for i in batch]


def plan_step(rollouts: list[Rollout], num_steps: int, world_size: int, token_budget: int, seed: int,
              packed: bool = False, skip_zero_advantage: bool = False) -> list[OptimizerStep]:
    """The optimiser steps of one rollout batch (`num_steps`, fewer if there are fewer groups), each cut into
    every rank's micro-batches (`packed`: the model's log-probs pack completions, so by split_packed). No rollouts
    (all masked, e.g. every completion truncated under rollout.mask_truncated): no step.

    `skip_zero_advantage`: rows whose advantage is 0 (all of a group whose samples scored alike) get no micro-batch,
    since every policy loss multiplies a row's terms by its advantage: without a KL term their gradient is exactly 0
    and running them changes nothing but the step's time. The normalisers still count them, so the step's gradient
    is the same. An optimiser step left with no row runs one dummy micro-batch: Adam's step still happens."""
    if not rollouts:
        return []
    lengths = [r.num_tokens for r in rollouts]
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_group.setdefault(r.group, []).append(i)
    groups = sorted(by_group)
    plan = []
    for chunk in mini_batches(len(groups), num_steps, seed):
        indices = [i for g in chunk for i in by_group[groups[g]]]
        trained = [i for i in indices if rollouts[i].advantage != 0] if skip_zero_advantage else indices
        per_rank = [split_packed(s, rollouts, token_budget) if packed else split_by_budget(s, lengths, token_budget)
                    for s in shard_by_tokens(trained, lengths, world_size)]
        count = max(1, max(len(m) for m in per_rank))
        plan.append(OptimizerStep([equalize(m, count) for m in per_rank], len(indices),
                                  sum(rollouts[i].num_sampled for i in indices)))
    return plan


def collate(rollouts: list[Rollout], indices: list[int], pad_id: int) -> MicroBatch:
    """Right-padded tensors of the given rollouts; an empty list gives a zero-weight copy of rollout 0."""
    weight = 1.0 if indices else 0.0
    chosen = indices or [0]
    rows = [rollouts[i] for i in chosen]
    width = max(r.num_tokens for r in rows)
    # Whole padded rows as lists, one tensor each: a row at a time took 2.8 ms for the quickstart's 128 rows.
    input_ids = torch.tensor([r.prompt_ids + r.completion_ids + [pad_id] * (width - r.num_tokens) for r in rows],
                             dtype=torch.long)
    engine_logp = torch.tensor([[0.0] * len(r.prompt_ids) + list(r.engine_logprobs) + [0.0] * (width - r.num_tokens)
                                for r in rows], dtype=torch.float32)
    position = torch.arange(width)
    ends = torch.tensor([r.num_tokens for r in rows])[:, None]
    attention_mask = (position < ends).long()
    loss_mask = (position >= torch.tensor([len(r.prompt_ids) for r in rows])[:, None]) & (position < ends)
    if any(r.sampled is not None for r in rows):  # episodes: the environment's tokens are not the policy's
        loss_mask &= torch.tensor([[False] * len(r.prompt_ids) + (r.sampled or [True] * len(r.completion_ids))
                                   + [False] * (width - r.num_tokens) for r in rows])
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return MicroBatch(chosen, input_ids, attention_mask, loss_mask, advantages, engine_logp, weight,
                      extras=_vision_extras(rows, width))


def _vision_extras(rows: list[Rollout], width: int) -> dict[str, Tensor]:
    """Each row's images travel with it: concatenated in row order, as the model consumes them."""
    with_images = [r for r in rows if r.mm]
    if not with_images:
        return {}
    types = torch.zeros((len(rows), width), dtype=torch.int32)
    for k, r in enumerate(rows):
        if r.mm:
            types[k, : len(r.prompt_ids)] = r.mm["mm_token_type_ids"]
    return {"pixel_values": torch.cat([r.mm["pixel_values"] for r in with_images]),
            "image_grid_thw": torch.cat([r.mm["image_grid_thw"] for r in with_images]), "mm_token_type_ids": types}
