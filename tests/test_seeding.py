"""apmpo.seeding: the engine seeds of training and evaluation never repeat, and all fit below 2**63.

A request with seed s asking for prompts x n samples owns the seeds [s, s + prompts * n) (the server's rule
`seed + i * n + j`), so disjoint ranges mean no repeated per-sample seed.
"""
import numpy as np
import pytest

from apmpo.seeding import EVAL_DOMAIN, check_training, eval_request_seed, train_request_seed

B, G, STEPS, ROUNDS = 512, 8, 1000, 4  # the paper's batch, 1,000 steps, up to 4 dynamic-sampling rounds


def assert_disjoint(ranges: list[tuple[int, int]]) -> None:
    ranges = sorted(ranges)
    for (start, end), (next_start, _) in zip(ranges, ranges[1:]):
        assert end <= next_start, (start, end, next_start)


def test_no_per_prompt_seed_repeats_across_1000_steps_of_the_papers_batch():
    requests = [train_request_seed(0, step, r, B * G) for step in range(1, STEPS + 1) for r in range(ROUNDS)]
    # Every per-prompt seed (request + i * G), counted: 1000 x 4 x 512 distinct values.
    per_prompt = (np.array(requests, dtype=np.uint64)[:, None] + np.arange(B, dtype=np.uint64)[None, :] * G).ravel()
    assert np.unique(per_prompt).size == STEPS * ROUNDS * B
    # And every per-sample seed: the requests' ranges of B * G seeds do not overlap.
    assert_disjoint([(s, s + B * G) for s in requests])
    assert max(requests) + B * G <= EVAL_DOMAIN  # training stays below the evaluation half
    # Another run seed gets other seeds too.
    assert not set(requests) & {train_request_seed(1, step, 0, B * G) for step in range(1, STEPS + 1)}


def test_training_and_eval_seeds_never_meet_and_fit_below_2_63():
    n, problems, chunk = 16, 500, 128
    eval_ranges = [(s, s + min(chunk, problems - c) * n)
                   for seed in range(3) for c in range(0, problems, chunk)
                   if (s := eval_request_seed(seed, c, n, min(chunk, problems - c)))]
    assert_disjoint(eval_ranges)
    assert min(s for s, _ in eval_ranges) >= EVAL_DOMAIN and max(e for _, e in eval_ranges) <= 2**63
    # Sample j of problem i is drawn with the same seed whichever request holds it.
    assert eval_request_seed(2, 130, n, 5) + 1 * n + 3 == eval_request_seed(2, 0, n, 500) + 131 * n + 3
    largest = train_request_seed(2**14 - 1, 2**20 - 1, 255, 2**20) + 2**20 - 1
    assert largest < EVAL_DOMAIN and eval_request_seed(2**30 - 1, 0, 1, 2**32) + 2**32 - 1 < 2**63


def test_out_of_range_fields_are_refused():
    with pytest.raises(ValueError, match="train.seed"):
        train_request_seed(2**14, 1, 0, 8)
    with pytest.raises(ValueError, match="sampling round"):
        train_request_seed(0, 1, 256, 8)
    with pytest.raises(ValueError, match="samples per request"):
        train_request_seed(0, 1, 0, 2**20 + 1)
    with pytest.raises(ValueError, match="problems \\* n"):
        eval_request_seed(0, 2**28, 16, 1)
    assert check_training(0, 400, 4, 4096) is None
    assert "train.steps = 1048576" in check_training(0, 2**20, 4, 4096)
    assert "rollout.max_sampling_rounds = 257" in check_training(0, 10, 257, 4096)
