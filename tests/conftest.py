"""Shared fixtures: tiny random Qwen2 checkpoints built in code (tied and untied embeddings)."""
import pytest

from apmpo.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The run directory of `launch/train.py --config configs/quickstart.yaml` with train_runs.QUICKSTART_RUN: one
    short run shared by every test that reads what a run leaves behind (see there)."""
    from train_runs import QUICKSTART_RUN, run, train_command  # noqa: PLC0415

    out = tmp_path_factory.mktemp("quickstart_run")
    run(train_command("configs/quickstart.yaml", *QUICKSTART_RUN, f"logging.output_dir={out}"), timeout=900)
    return out / "quickstart"
