"""Multi-turn episodes without a server (issue 29): the transcript's ids (turn k+1's prompt is turn k's prompt, its
sampled ids and the environment's ids, id for id), the append-only checks, the calculator, the loss mask through
collate and the log-probs, exactly zero gradient on environment tokens in every loss, and the config keys.
The episodes themselves, on a real server: tests/test_envs_server.py."""
import math
import re
from types import SimpleNamespace
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from apmpo import preflight
from apmpo.config import ConfigError, CorrectionConfig, load_config
from apmpo.envs import get_env
from apmpo.envs.calculator import EXAMPLE, CalculatorEnv, calculate, tool_reply
from apmpo.envs.chat import TemplateError, Transcript
from apmpo.envs.episodes import EpisodeLimits, EpisodeRunner
from apmpo.envs.workers import check_step
from apmpo.envs.reveal import RevealEnv
from apmpo.learner.batching import collate, plan_step
from apmpo.trajectory import Rollout
from apmpo.learner.logprobs import token_logprobs
from apmpo.learner.update import importance_weights
from apmpo.loss import POLICY_LOSSES, LossConfig, adaptive_params, policy_loss
from apmpo.quickstart import build_tokenizer as quickstart_tokenizer
from apmpo.sampling import Sampling
from apmpo.tiny import build_model, build_tokenizer


@pytest.fixture(scope="module")
def quickstart_tok():
    return quickstart_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    return build_tokenizer()  # byte-level BPE with merges: a text has several tokenisations


# --- the transcript: tokens in, tokens out ---------------------------------------------------------------------


def test_quickstart_turns_append_sampled_then_environment_ids(quickstart_tok):
    tok = quickstart_tok
    end, ids_of = tok.eos_token_id, tok.convert_tokens_to_ids
    chat = Transcript(tok, [{"role": "user", "content": "start"}])
    prompt = tok("<|im_start|>user\nstart<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert chat.ids == prompt and chat.prompt_length == 24
    sampled = [ids_of("3"), ids_of("a"), end]  # the stop token stays part of the sampled ids
    assert chat.add_sampled(sampled, [end]) == "3a"  # what the environment reads: the text, without the stop
    env_ids = chat.add_message({"role": "user", "content": "385"})
    # After the sampled <|im_end|>: the newline the template puts after it, the message and the generation prompt.
    assert tok.decode(env_ids) == "\n<|im_start|>user\n385<|im_end|>\n<|im_start|>assistant\n"
    assert chat.ids == prompt + sampled + env_ids  # id for id: nothing before is touched
    # A turn cut by max_tokens (no stop token): the environment's ids close it as the template does.
    turn_two = [ids_of("9")]
    assert chat.add_sampled(turn_two, [end]) == "9"
    closing = chat.add_message({"role": "user", "content": "12"})
    assert tok.decode(closing) == "<|im_end|>\n<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"
    assert chat.ids == prompt + sampled + env_ids + turn_two + closing
    assert chat.ids == tok(chat.text, add_special_tokens=False)["input_ids"]  # the character vocabulary: canonical


def test_sampled_ids_are_never_retokenised(bpe_tok):
    """Sampled ids that are not the tokenizer's own tokenisation of their text (one token per character) stay as
    they are; re-tokenising the conversation would merge them."""
    tok = bpe_tok
    chat = Transcript(tok, [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 3 + 4?"}])
    before = list(chat.ids)
    text = "The answer is"
    sampled = [tok.convert_tokens_to_ids(c if c != " " else "Ġ") for c in text] + [tok.eos_token_id]
    assert tok(text, add_special_tokens=False)["input_ids"] != sampled[:-1]  # the canonical form differs
    assert chat.add_sampled(sampled, [tok.eos_token_id]) == text
    env_ids = chat.add_message({"role": "user", "content": "Compute 12 * 12 please."})
    assert chat.ids == before + sampled + env_ids
    expected = "\n<|im_start|>user\nCompute 12 * 12 please.<|im_end|>\n<|im_start|>assistant\n"
    assert env_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok(chat.text, add_special_tokens=False)["input_ids"] != chat.ids  # re-tokenising would change them


def test_a_template_that_rewrites_earlier_turns_is_refused(bpe_tok):
    tok = _with_template(bpe_tok, (
        # Like templates that drop the reasoning of earlier assistant turns: an assistant message renders in full
        # only while it is the last message.
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    chat = Transcript(tok, [{"role": "user", "content": "hi"}])
    chat.add_sampled(tok("hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [tok.eos_token_id])
    with pytest.raises(TemplateError, match="is not append-only: adding a 'user' message changes how the earlier"):
        chat.add_message({"role": "user", "content": "again"})


def test_a_template_whose_turn_end_is_not_the_stop_token_is_refused(bpe_tok):
    tok = _with_template(bpe_tok, (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% else %}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    chat = Transcript(tok, [{"role": "user", "content": "hi"}])
    chat.add_sampled(tok("hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [tok.eos_token_id])
    with pytest.raises(TemplateError, match=r"renders the conversation differently from its tokens so far.*"
                                            r"tokens '[^']*hello<\|im_end\|>', template '[^']*hello<\|endoftext\|>"):
        chat.add_message({"role": "user", "content": "again"})


def test_a_tokenizer_without_a_chat_template_is_refused(bpe_tok):
    with pytest.raises(TemplateError, match="has no chat template"):
        Transcript(_with_template(bpe_tok, None), [{"role": "user", "content": "hi"}])


def _with_template(tok, template):
    copy = build_tokenizer()
    copy.chat_template = template
    return copy


# --- the environments -------------------------------------------------------------------------------------------


def test_reveal_env_reveals_then_rewards_a_revealed_digit():
    env = get_env("reveal")()
    assert isinstance(env, RevealEnv)
    sample = {"answer": "385"}
    assert env.reset(sample) == "start"
    assert env.step("anything") == ("385", None, False)
    assert env.step("8") == ("", 1.0, True)
    env.reset(sample)
    env.step("")
    assert env.step("2") == ("", 0.0, True)


def test_the_readmes_environment_plays_as_the_builtin_reveal(tmp_path, monkeypatch):
    """The README's example, written to a file and named as a user names theirs (data.env: my_envs:RevealDigits),
    answers every action as `reveal` does."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [code] = re.findall(r"```python\n(# my_envs\.py.*?)```", readme, re.DOTALL)
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    theirs, ours = get_env("my_envs:RevealDigits")(), RevealEnv()
    for answer in ("385", "012"):
        for actions in (["x", "8"], ["", "2"], ["5", " 0"], ["1", ""]):
            sample = {"answer": answer}
            assert theirs.reset(sample) == ours.reset(sample)
            assert [theirs.step(a) for a in actions] == [ours.step(a) for a in actions]


@pytest.mark.parametrize("expression, value", [
    ("3*4+2", 14), ("(1 + 2) * -3", -9), ("7/2", Fraction(7, 2)), ("0.1+0.2", Fraction(3, 10)), ("+5 - -5", 10),
    ("1/3*3", 1), ("12.5 * 4", 50), ("(" * 99 + "1" + ")" * 99, 1),
])
def test_calculator_computes_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("2**10", "only numbers"), ("x + 1", "only numbers"),
    ("1/0", "division by zero"), ("1/(2-2)", "division by zero"), ("3 +", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"), ("True + 1", "only numbers"), ("'a' * 3", "only numbers"),
    ("((1)", "not an arithmetic expression"),
])
def test_calculator_refuses_anything_but_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


def test_calculator_env_answers_calls_then_scores_the_final_answer():
    env = CalculatorEnv()
    sample = {"question": "Tom has 3 bags of 4 apples and buys 2 more. How many?", "answer": "14"}
    first = env.reset(sample)
    assert first[0]["role"] == "system" and "<calc>" in first[0]["content"]
    # the worked example (chat turns in the tool's format: without it SmolLM2-135M never calls the tool), then the
    # question; the sample's own system prompt is replaced
    assert first[1:-1] == list(EXAMPLE) and first[-1] == {"role": "user", "content": sample["question"]}
    assert "<calc>" in EXAMPLE[1]["content"] and tool_reply(EXAMPLE[1]["content"]) == EXAMPLE[2]["content"]
    assert "\\boxed{7}" in EXAMPLE[3]["content"] and tool_reply(EXAMPLE[3]["content"]) is None
    assert env.step("Let me compute <calc>3*4+2</calc> and <calc>7/2</calc> and <calc>1/0</calc>") == (
        "<result>14</result>\n<result>3.5</result>\n<result>error: division by zero</result>", None, False)
    assert env.step("So \\boxed{14}.") == ("", 1.0, True)
    env.reset({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "2+2?"}], "answer": "4"})
    assert env.step("\\boxed{5}") == ("", 0.0, True)
    assert tool_reply("no call here") is None


def test_calculator_result_too_large_for_a_float_is_an_error_message():
    reply = tool_reply("<calc>1e308*1e308/3</calc>")
    assert reply.startswith("<result>error: ") and reply.endswith("</result>")


@pytest.mark.parametrize("value, message", [
    (("obs", None), "step must return"), ("obs", "step must return"), (("obs", 1.0, 1), "done must be a bool"),
    (("obs", "1", True), "reward must be a number"), (("obs", math.nan, True), "nan, not a finite float32"),
    (("obs", math.inf, False), "inf, not a finite float32"),
    (("obs", 1e300, True), r"1e\+300, not a finite float32"),  # finite in Python, inf as the float32 trained on
])
def test_malformed_step_results_are_rejected(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        check_step(value)


class _ScriptedClient:
    """Answers each prompt of a request with the next scripted (token ids, finish reason) of its episode."""

    def __init__(self, script):
        self.script, self.turn = script, 0

    def generate(self, prompts, sampling, n, seeds):
        outs = [[SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), weight_version=0, finish_reason=reason)]
                for ids, reason in self.script[self.turn][:len(prompts)]]
        self.turn += 1
        return outs


def test_an_episode_whose_last_turn_was_cut_at_max_tokens_is_truncated(quickstart_tok, monkeypatch):
    """A final turn cut by the per-turn token limit (no stop token) ends as "length" even when the environment then
    ends the episode (the calculator scores any turn without a call), so response/truncated_frac, eval's truncated_frac
    and rollout.mask_truncated see it, as they see a single-turn completion cut at max_tokens. The reward is the
    environment's. SmolLM2-135M cut 30% of its calculator episodes' last turns at 128 tokens, reported as 0%."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # its workers import flaky_envs, not this module
    from flaky_envs import EndsAtOnce

    tok, end = quickstart_tok, quickstart_tok.eos_token_id
    digit = tok.convert_tokens_to_ids("3")
    limits = EpisodeLimits(max_turns=2, max_episode_tokens=16, max_prompt_tokens=64, max_model_len=128, timeout_s=5.0)
    sampling = Sampling(max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(end,))
    client = _ScriptedClient([[([digit, end], "stop"), ([digit] * 3, "length")]])
    episodes, _ = EpisodeRunner(EndsAtOnce, tok, limits).run(client, [{}, {}], lambda e, t: 0, sampling)
    assert [e.finish_reason for e in episodes] == ["stop", "length"]
    assert [e.reward for e in episodes] == [1.0, 1.0]
    # cut by the episode's token budget: the same
    client = _ScriptedClient([[([digit] * 3 + [end], "stop")]])
    tight = EpisodeLimits(**{**limits.__dict__, "max_episode_tokens": 2})
    assert EpisodeRunner(EndsAtOnce, tok, tight).run(client, [{}], lambda e, t: 0, sampling)[0][0].finish_reason \
        == "length"


def test_get_env_names_what_is_wrong():
    with pytest.raises(ValueError, match="unknown environment 'revel'"):
        get_env("revel")
    with pytest.raises(TypeError, match="does not name a class with reset"):
        get_env("apmpo.envs.calculator:calculate")


# --- the loss mask ------------------------------------------------------------------------------------------------


def _episode(prompt, turns):
    """A Rollout of an episode: turns = [(ids, sampled)], sampled tokens' engine log-probs -0.5."""
    ids = [t for part, _ in turns for t in part]
    sampled = [flag for part, flag in turns for _ in part]
    return Rollout(list(prompt), ids, [-0.5 if s else 0.0 for s in sampled], "stop", group=0, reward=1.0,
                   advantage=1.0, sampled=sampled, weight_versions=[3, 4])


def test_collate_masks_environment_tokens_and_the_plan_counts_only_sampled_ones():
    episode = _episode([5, 6, 7], [([8, 9], True), ([10, 11, 12], False), ([13], True)])
    single = Rollout([5, 6], [8, 9, 2], [-0.1, -0.2, -0.3], "stop", group=1)
    mb = collate([episode, single], [0, 1], pad_id=0)
    assert mb.loss_mask.tolist() == [[False] * 3 + [True, True, False, False, False, True],
                                     [False, False, True, True, True] + [False] * 4]
    assert mb.engine_logp[0].tolist() == [0, 0, 0, -0.5, -0.5, 0, 0, 0, -0.5]
    assert episode.num_sampled == 3 and single.num_sampled == 3
    (step,) = plan_step([episode, single], 1, 1, 4096, seed=0)
    assert step.num_tokens == 6  # DAPO's token normaliser: sampled tokens only


@pytest.mark.parametrize("packed", [True, False])
def test_logprobs_of_an_episode_score_only_sampled_tokens_packed_or_not(bpe_tok, packed):
    """The packed path (a group's rows share their prompt) gives the plain forward's log-probs on rows whose
    scored tokens have environment tokens between them."""
    model = build_model(bpe_tok, seed=1)
    if not packed:
        model.config.use_sliding_window = True  # shares_prompts then says no: whole rows (max_window_layers unset)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, len(bpe_tok), (6,), generator=g).tolist()
    rows = []
    for k in range(3):
        parts = [(torch.randint(3, len(bpe_tok), (n,), generator=g).tolist(), s)
                 for n, s in ((2 + k, True), (4, False), (1 + k, True), (3, False), (2, True))]
        rows.append(_episode(prompt, parts))
    mb = collate(rows, [0, 1, 2], pad_id=0)
    logp, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.loss_mask)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float(), -1)
    expected = torch.zeros_like(logp)
    expected[:, 1:] = full[:, :-1].gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    expected = torch.where(mb.loss_mask, expected, 0.0)
    torch.testing.assert_close(logp.detach(), expected, rtol=1e-5, atol=1e-5)
    assert (logp[~mb.loss_mask] == 0).all()


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked-in entries moved to its front, zeros after: the sequence without its environment tokens."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][mask[i]]
        out[i, : len(kept)] = kept
    return out


@pytest.mark.parametrize("correction", ["off", "token", "sequence"])
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_environment_tokens_get_exactly_zero_gradient_in_every_loss(name, correction):
    """Every loss, with its KL term and rollout correction, on rows whose mask has holes (environment tokens that
    hold garbage log-probs), against the same rows with those tokens removed: the same loss and gradients, and
    exactly zero gradient at the masked tokens."""
    g = torch.Generator().manual_seed(7)
    N, T = 6, 14
    mask = torch.rand(N, T, generator=g) < 0.55
    mask[:, 0] = True  # every row samples something
    mask[2, 5:] = False  # a row whose episode ended early (padding after it)
    def randn(scale):
        return scale * torch.randn(N, T, generator=g, dtype=torch.float64)
    logp, old = -1 + randn(0.3), -1 + randn(0.3)
    ref, engine = -1 + randn(0.3), -1 + randn(0.3)
    for t in (logp, old, ref, engine):
        t[~mask] = 40.0 * torch.randn(int((~mask).sum()), generator=g, dtype=torch.float64)  # garbage, not 0
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    advantages[3] = 0.0
    rewards = (torch.rand(2, 3, generator=g) < 0.5).float()
    cfg = LossConfig(name=name, kl_beta=0.1, token_budget=16)
    params = adaptive_params(rewards, cfg)
    counts = {"num_seqs": float(N), "num_tokens": float(mask.sum())}

    def loss_of(logp_, old_, ref_, engine_, mask_):
        weights = None
        adv = advantages
        if correction != "off":
            w, _ = importance_weights(old_, engine_, mask_, CorrectionConfig(mode="tis", level=correction, tis_cap=1.5))
            adv, weights = (adv * w, None) if correction == "sequence" else (adv, w)
        return policy_loss(logp_, old_, adv, mask_, cfg, params, ref_logp=ref_, token_weights=weights, **counts)[0]

    holey = logp.clone().requires_grad_(True)
    loss = loss_of(holey, old, ref, engine, mask)
    loss.backward()
    compact_mask = _compact(mask, mask)
    compact = _compact(logp, mask).requires_grad_(True)
    reference = loss_of(compact, _compact(old, mask), _compact(ref, mask), _compact(engine, mask), compact_mask)
    reference.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    assert (holey.grad[~mask] == 0).all()  # exactly: not small, zero
    torch.testing.assert_close(_compact(holey.grad, mask), compact.grad, rtol=1e-10, atol=1e-12)
    assert compact.grad[compact_mask].abs().sum() > 0  # the comparison is not between zeros


# --- config -------------------------------------------------------------------------------------------------------


def test_multiturn_config_loads_with_its_limits():
    cfg = load_config("configs/quickstart_multiturn.yaml")
    assert (cfg.data.env, cfg.data.max_turns, cfg.data.max_episode_tokens, cfg.rollout.max_tokens) == ("reveal", 2, 32, 1)
    # Dr. GRPO's token budget: the tokens an episode's turns may sample (2 turns of 1), or fewer if the episode's
    # token limit says so.
    assert load_config("configs/quickstart_multiturn.yaml", ["loss.name=dr_grpo"]).loss.token_budget == 2 * 1
    assert load_config("configs/quickstart_multiturn.yaml", ["loss.name=dr_grpo", "rollout.max_tokens=30"]
                       ).loss.token_budget == 32


def test_the_env_workers_memory_cap_and_answer_bound_come_from_the_config(quickstart_tok):
    cfg = load_config("configs/quickstart_multiturn.yaml", ["rollout.env_memory_mb=300"])
    workers = EpisodeRunner.from_config(cfg, quickstart_tok).workers
    # the quickstart vocabulary's longest token (<|endoftext|>, 13 characters) times the longer token limit (the
    # first prompt's 64; the episode's is 32)
    assert (workers.memory_mb, workers.max_chars) == (300, 13 * 64)
    assert EpisodeRunner.from_config(load_config("configs/quickstart_multiturn.yaml"), quickstart_tok
                                     ).workers.memory_mb == 4096  # as reward workers: apmpo.sandbox.MEMORY_MB


@pytest.mark.parametrize("overrides, message", [
    (["data.env=revel"], "data.env 'revel': ValueError: unknown environment 'revel'"),
    (["data.env="], "data.env is empty"),  # it meant single-turn, silently
    (["data.env=apmpo.envs:Environment"], "'apmpo.envs:Environment' is an interface"),  # the Protocol itself
    (["data.env=flaky_envs:Abstract"], "'flaky_envs:Abstract' is an interface (a Protocol or a class with abstract "
                                       "methods ['step'])"),
    (["data.env=exiting_envs:Env"], "data.env 'exiting_envs:Env': ImportError: importing 'exiting_envs' called "
                                    "sys.exit(7)"),  # the run ended with exit 7 and no message
    (["data.max_turns=0"], "data.max_turns must lie in [1, 1024], got 0"),
    (["data.max_episode_tokens=100"], ("data.max_prompt_tokens (64) + data.max_episode_tokens (100) > "
                                       "rollout.max_model_len (128)")),
    (["data.env_timeout_s=0"], "data.env_timeout_s must lie in (0, 86400]"),
    (["rollout.overlong_buffer=1"], "rollout.overlong_buffer is per completion"),
    # Each turn of each episode has an engine seed of its own: 4096 x 2 x 200 > 2**20 per request.
    (["data.max_turns=200", "rollout.prompts_per_step=4096", "train.mini_batch_size=4096", "rollout.group_size=2"],
     "rollout.prompts_per_step * rollout.group_size = 1638400 is outside the engine-seed layout"),
])
def test_bad_episode_config_fails_at_load_naming_the_key(overrides, message, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # flaky_envs, exiting_envs
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.check(load_config("configs/quickstart_multiturn.yaml", overrides))


# --- per-episode seeds in the generation request -----------------------------------------------------------------


def test_a_request_takes_one_seed_per_prompt_or_one_seed_not_both():
    from pydantic import ValidationError

    from apmpo.rollout.protocol import MAX_SEED, GenerateRequest

    body = {"prompts": [[1, 2], [3]], "n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4}
    assert GenerateRequest(**body, seeds=[5, 9]).seeds == [5, 9]
    for bad in ({"seeds": [5]}, {"seeds": [5, 9], "seed": 1}, {"seeds": [5, -1]}, {"seeds": [5, MAX_SEED]}):
        with pytest.raises(ValidationError, match="seeds: one per prompt"):
            GenerateRequest(**body, **bad)


def test_eval_refuses_an_environment_module_that_exits_on_import(monkeypatch):
    from apmpo.eval.__main__ import check_env
    from apmpo.eval.run import EvalError

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(EvalError, match=re.escape("--env 'exiting_envs:Env': ImportError: importing 'exiting_envs' "
                                                  "called sys.exit(7)")):
        check_env("exiting_envs:Env")
