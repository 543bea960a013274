"""model.compile: the learner's compiled MLP and RMSNorm blocks give the naive reference's log-probs and gradients,
keep the state dict's keys, and fall back to eager, saying why, where Inductor cannot compile."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from apmpo.config import ConfigError, load_config
from apmpo.learner.compiled import compile_elementwise
from apmpo.learner.logprobs import token_logprobs
from test_logprobs import assert_grads_close, grads_of, make_group_batch, make_model, reference, tokenizer


@pytest.fixture(scope="module")
def models():
    """An eager tiny model and a compiled copy of it, with the compiler's log line."""
    eager = make_model(tied=True).train()
    compiled = copy.deepcopy(eager)
    return eager, compiled, compile_elementwise(compiled)


def test_compiled_blocks_give_the_naive_values_and_gradients(models):
    eager, compiled, line = models
    # 2 layers x (MLP + 2 norms) + the last norm
    assert line.startswith("model.compile: 7 MLP and RMSNorm blocks compiled in ")
    batch = make_group_batch(len(tokenizer()), seed=2)
    weights = torch.randn(batch[0].shape, generator=torch.Generator().manual_seed(1))
    logp, entropy = token_logprobs(compiled, *batch, temperature=0.6, chunk_tokens=7, with_entropy=True)
    ref_logp, ref_entropy = reference(eager, *batch, 0.6)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_of(compiled, logp, weights), grads_of(eager, ref_logp, weights))
    # The blocks did run compiled: the compiled forward is not the eager one to the last digit.
    assert not torch.equal(logp, token_logprobs(eager, *batch, temperature=0.6)[0])
    # Old log-probs (no gradients) and the update's forward: the same compiled graphs' values.
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(compiled, *batch, temperature=0.6)[0], logp.detach(),
                                   rtol=1e-6, atol=1e-6)


def test_compiling_keeps_the_state_dict(models):
    eager, compiled, _ = models
    assert list(compiled.state_dict()) == list(eager.state_dict())


FALLBACK = """
import torch, torch._inductor.config as inductor
from apmpo.learner.compiled import compile_elementwise
from apmpo.tiny import build_model, build_tokenizer
inductor.cpp.cxx = ("/nonexistent/c++",)  # a machine without a C++ compiler
model = build_model(build_tokenizer())
print(compile_elementwise(model))
ids = torch.tensor([[1, 5, 6, 7]])
print(torch.equal(model(ids).logits, build_model(build_tokenizer())(ids).logits))
"""


def test_a_platform_that_cannot_compile_trains_eager_and_says_why(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line, same = done.stdout.strip().splitlines()[-2:]
    assert line.startswith("model.compile: fell back to eager: ") and "nonexistent" in done.stdout + done.stderr
    assert same == "True"  # eager again: the same logits as a model never compiled (build_model is seeded)


def test_compile_is_refused_with_zero3():
    with pytest.raises(ConfigError, match="model.compile needs train.zero_stage <= 2"):
        load_config(None, ["model.compile=true", "train.zero_stage=3"])
