"""apmpo.play.play, the one path from prompts to scored trajectories that training and evaluation share: which
engine seed each sample and turn draws with (the layout of apmpo.seeding, checked against its own functions), that
a call playing only some samples draws each as the whole call would, and what comes back. Single-turn samples come
from tests/fakes.py's FakeServer (a fake: its answers follow from the seed, so the draw is visible in the reward);
episodes run in the real EpisodeRunner and its worker processes, served by a client that records the seeds it is
asked for (a fake for the same reason)."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from apmpo import seeding
from apmpo.envs.episodes import EpisodeLimits, EpisodeRunner
from apmpo.quickstart import build_tokenizer
from apmpo.sampling import Sampling
from apmpo.play import play
from fakes import FakeServer

RECORDS = [{"id": i, "answer": "1", "reward": 0.25 * i} for i in range(4)]
PROMPTS = [[10 + i, 20 + i] for i in range(4)]
SAMPLING = Sampling(max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(2,))


def score(texts, records):
    return [float(text == "right") for text in texts], SimpleNamespace(failures=0)


def fake_server():
    return FakeServer(None, RECORDS, right=lambda record: "right", wrong="wrong",
                      prompts={tuple(p): r for p, r in zip(PROMPTS, RECORDS)})


def test_single_turn_sample_j_of_prompt_k_draws_first_seed_plus_k_n_plus_j():
    n, first = 3, seeding.train_request_seed(run_seed=5, step=7, round_=1, num_samples=4 * 3)
    rollouts, _, times = play(fake_server(), PROMPTS, RECORDS, n, first, SAMPLING, score=score)
    assert [r.reward for r in rollouts] == [float((first + k * n + j) % 3 == 0) for k in range(4) for j in range(n)]
    assert [r.prompt_ids for r in rollouts] == [p for p in PROMPTS for _ in range(n)]
    assert all(r.group == -1 and r.sampled is None and r.weight_versions == [0] and r.text in ("right", "wrong")
               and r.num_sampled == 3 == len(r.engine_logprobs) for r in rollouts)
    assert set(times) == {"generate", "reward"}


def test_a_call_that_keeps_some_samples_draws_each_as_the_whole_call_does():
    n, first = 4, seeding.eval_request_seed(eval_seed=2, first_problem=8, n=4, num_problems=4)
    whole, _, _ = play(fake_server(), PROMPTS, RECORDS, n, first, SAMPLING, score=score)
    keep = lambda k, j: (k + j) % 3 == 0  # noqa: E731
    part, _, _ = play(fake_server(), PROMPTS, RECORDS, n, first, SAMPLING, score=score, keep=keep)
    assert [(r.reward, r.text) for r in part] == [(r.reward, r.text) for i, r in enumerate(whole) if keep(*divmod(i, n))]


class SeedRecorder:
    """Answers every turn of every episode with one token, and records the seed each was asked for."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, sampling, n, seeds):
        self.seeds.append(list(seeds))
        return [[SimpleNamespace(token_ids=[7], logprobs=[-0.5], weight_version=3, finish_reason="stop")]
                for _ in prompts]


@pytest.mark.parametrize("domain", ["train", "eval"])
def test_episode_turn_t_of_sample_j_of_prompt_k_draws_the_seed_layouts_seed(domain, monkeypatch):
    """Training's and evaluation's episodes draw as they did when each had its own path: training's turn t of
    episode e (prompt-major) with turn_seed(train_request_seed(..., prompts x n x T), e, T, t); evaluation's of sample
    j of problem i with turn_seed(eval_request_seed(seed, i, n x T, 1), j, T, t), for the problems of a call and
    the samples it keeps."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the workers import flaky_envs
    from flaky_envs import NeverEnds

    n, T, first_problem = 2, 3, 6
    tok = build_tokenizer()
    runner = EpisodeRunner(NeverEnds, tok, EpisodeLimits(max_turns=T, max_episode_tokens=200, max_prompt_tokens=64,
                                                         max_model_len=512, timeout_s=10.0))
    keep = (lambda k, j: True) if domain == "train" else (lambda k, j: (k, j) != (1, 0))
    wanted = [(k, j) for k in range(len(RECORDS)) for j in range(n) if keep(k, j)]
    if domain == "train":
        first = seeding.train_request_seed(run_seed=1, step=4, round_=0, num_samples=len(RECORDS) * n * T)
        expected = [[seeding.turn_seed(first, k * n + j, T, t) for k, j in wanted] for t in range(T)]
    else:
        first = seeding.eval_request_seed(3, first_problem, n * T, len(RECORDS))
        expected = [[seeding.turn_seed(seeding.eval_request_seed(3, first_problem + k, n * T, 1), j, T, t)
                     for k, j in wanted] for t in range(T)]
    client = SeedRecorder()
    try:
        rollouts, summary, times = play(client, PROMPTS, RECORDS, n, first, SAMPLING, episodes=runner, keep=keep)
    finally:
        runner.close()
    assert client.seeds == expected
    assert [r.reward for r in rollouts] == [RECORDS[k]["reward"] for k, _ in wanted]
    assert all(r.finish_reason == "length" and r.weight_versions == [3] * T and r.num_sampled == T
               and len(r.sampled) == len(r.completion_ids) == len(r.engine_logprobs) > T for r in rollouts)
    assert summary.failures == 0 and summary.turns == T * len(wanted) and set(times) == {"generate", "env"}
