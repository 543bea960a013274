"""Asynchronous training's batch stream (apmpo.learner.collect.RolloutStream): prefetch depth, the staleness
bound, where a resume samples from. Generation is a stand-in here (a function that records when it ran and with
which server weights); the end-to-end runs with the real server are in tests/test_train_cli.py."""
import threading

import pytest
import torch

from apmpo.learner.batching import StepRollouts
from apmpo.learner.collect import PromptSampler, RolloutStream


class Server:
    """The weight version a real server would report: bumped by each push."""

    def __init__(self):
        self.version, self.calls = 0, []

    def collect(self, step):
        self.calls.append((step, self.version, threading.current_thread().name))
        return StepRollouts([], torch.zeros(1, 2), None, {}, {}, weight_version=self.version,
                            sampler_before={"position": 10 * step})


def test_synchronous_stream_collects_in_the_callers_thread():
    server = Server()
    stream = RolloutStream(server.collect, max_staleness=0, last_step=3)
    for step in (1, 2, 3):
        assert stream.get(step, policy_version=server.version).weight_version == server.version
        server.version += 1  # the step's push
    assert server.calls == [(1, 0, "MainThread"), (2, 1, "MainThread"), (3, 2, "MainThread")]


@pytest.mark.parametrize("depth", [1, 2])
def test_batches_are_generated_ahead_within_the_bound(depth):
    server = Server()
    stream = RolloutStream(server.collect, max_staleness=depth, last_step=6)
    for step in range(1, 7):
        batch = stream.get(step, policy_version=server.version)
        assert sorted(stream._pending) == list(range(step + 1, min(step + depth, 6) + 1))  # queued ahead
        assert 0 <= server.version - batch.weight_version <= depth
        server.version += 1
    stream.close()
    assert [c[0] for c in server.calls] == [1, 2, 3, 4, 5, 6] and stream.discarded == 0
    assert all(name == "rollouts" for _, _, name in server.calls)
    assert server.calls[0][1] == 0  # the first batch, with the initial weights


def test_a_batch_staler_than_the_bound_is_never_trained_on():
    server = Server()
    stream = RolloutStream(server.collect, max_staleness=1, last_step=3)
    assert stream.get(1, policy_version=0).weight_version == 0  # step 2 is now generated at version 0
    stream.sampler_state(2, PromptSampler(5, 0))  # waits until step 2's batch is there
    server.version = 3  # three pushes since: step 2's batch is 3 versions old
    batch = stream.get(2, policy_version=3)
    assert batch.weight_version == 3 and stream.discarded == 1  # dropped, generated again with fresh weights
    stream.close()


def test_resume_samples_from_before_the_batch_in_flight():
    server = Server()
    stream = RolloutStream(server.collect, max_staleness=1, last_step=3)
    stream.get(1, policy_version=0)
    sampler = PromptSampler(5, 0)
    assert stream.sampler_state(2, sampler) == {"position": 20}  # step 2's batch is regenerated on resume
    stream.get(2, policy_version=1)
    stream.get(3, policy_version=2)
    assert stream.sampler_state(4, sampler) == sampler.state_dict()  # nothing in flight after the last step
    stream.close()


def test_a_failed_generation_is_raised_in_the_training_thread():
    def collect(step):
        raise ConnectionError(f"server died during step {step}")

    stream = RolloutStream(collect, max_staleness=1, last_step=2)
    with pytest.raises(ConnectionError, match="server died during step 1"):
        stream.get(1, policy_version=0)
    stream.close()
