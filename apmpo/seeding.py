"""The engine seeds of training and evaluation, from one place, collision-free by construction.

The generation server draws sample j of prompt i of a request with the engine seed `seed + i * n + j` (its rule,
apmpo/rollout/server.py, and vLLM's for the n children of one prompt). A request therefore owns the seed range
[seed, seed + prompts * n). The functions below give every request its own range in a 63-bit space:

    bit 62      61 ............................................................................ 0
    0 (train) | run seed (14 bits) | step (20 bits) | round (8 bits) | sample of the request (20 bits)
    1 (eval)  | eval seed (30 bits)                 | sample = problem * n + j (32 bits)

Fields never overlap, so no two (run seed, step, round, prompt, sample) and no (eval seed, problem, sample) share a
seed; every seed is below 2**63, so any engine that keeps seeds in a signed or unsigned 64-bit integer takes it.
A CPU engine's generator (torch's mt19937) keeps only 32 bits of a seed, so there the server hands vLLM each
prompt's seed hashed to 32 bits (apmpo.rollout.vllm_compat.engine_seed): distinct by chance, not by construction.
The ranges are checked (ValueError naming the limit); `check_training` does it once for a whole run at config load.

    seed = train_request_seed(run_seed=0, step=12, round_=1, num_samples=512 * 8)  # client.generate(..., seed=seed)
    seed = eval_request_seed(eval_seed=0, first_problem=128, n=16, num_problems=128)

Multi-turn episodes (apmpo.envs) send each turn of each episode with a seed of its own (the server's per-prompt
`seeds`): episode e's turn t draws with `first + e * max_turns + t`, where `first` is the seed of a single-turn
request for max_turns times as many samples (`turn_seed`). So a turn's draw depends on its episode and turn only,
never on which other episodes are still running, and with max_turns 1 it is the single-turn seed.
"""
from __future__ import annotations

SAMPLE_BITS, ROUND_BITS, STEP_BITS, RUN_BITS = 20, 8, 20, 14  # training: 62 bits below the domain bit
EVAL_SAMPLE_BITS, EVAL_SEED_BITS = 32, 30  # evaluation: 62 bits below the domain bit
EVAL_DOMAIN = 1 << 62
# Written into an evaluation's config.json: samples drawn under another scheme must not be mixed in.
EVAL_SCHEME = "2^62 + eval_seed * 2^32 + problem * n + j"


def _check(name: str, value: int, bits: int) -> None:
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name} must lie in [0, {1 << bits}), got {value}")


def train_request_seed(run_seed: int, step: int, round_: int, num_samples: int) -> int:
    """The seed of the training request of `step` and dynamic-sampling round `round_` (0 first), which asks for
    `num_samples` = prompts x n samples. Below 2**62: training never meets an evaluation seed."""
    _check("train.seed", run_seed, RUN_BITS)
    _check("step", step, STEP_BITS)
    _check("the sampling round", round_, ROUND_BITS)
    _check("samples per request (rollout.prompts_per_step * group_size)", num_samples - 1, SAMPLE_BITS)
    return ((run_seed << STEP_BITS | step) << ROUND_BITS | round_) << SAMPLE_BITS


def eval_request_seed(eval_seed: int, first_problem: int, n: int, num_problems: int) -> int:
    """The seed of an evaluation request holding problems first_problem .. first_problem + num_problems - 1 (a
    contiguous run): sample j of problem i is drawn with 2**62 + eval_seed * 2**32 + i * n + j, whichever problems
    share its request."""
    _check("the eval seed", eval_seed, EVAL_SEED_BITS)
    _check("the last sample's index (problems * n)", (first_problem + num_problems) * n - 1, EVAL_SAMPLE_BITS)
    return EVAL_DOMAIN | eval_seed << EVAL_SAMPLE_BITS | first_problem * n


def check_training(run_seed: int, steps: int, rounds: int, num_samples: int) -> str | None:
    """None if every request of a run fits the layout, else a message naming the config key at fault."""
    maxima = [("train.seed", run_seed, (1 << RUN_BITS) - 1), ("train.steps", steps, (1 << STEP_BITS) - 1),
              ("rollout.max_sampling_rounds", rounds, 1 << ROUND_BITS),  # rounds 0 .. rounds - 1
              ("rollout.prompts_per_step * rollout.group_size", num_samples, 1 << SAMPLE_BITS)]
    for key, value, maximum in maxima:
        if not 0 <= value <= maximum:
            return f"{key} = {value} is outside the engine-seed layout (apmpo/seeding.py): at most {maximum}"
    return None


def turn_seed(first: int, episode: int, max_turns: int, turn: int) -> int:
    """The seed of turn `turn` (0 first) of episode `episode` of a request whose seed range starts at `first` and
    was sized for episodes x max_turns samples (train_request_seed / eval_request_seed)."""
    if not 0 <= turn < max_turns:
        raise ValueError(f"turn {turn} outside [0, max_turns={max_turns})")
    return first + episode * max_turns + turn
