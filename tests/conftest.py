"""Shared fixtures: tiny random Qwen2 checkpoints built in code (tied and untied embeddings)."""
import pytest

from apmpo.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tie_word_embeddings=False)
