"""ACS's sentence embeddings (apmpo.embeddings): pooling against a per-row loop, the folder's pipeline as
sentence-transformers reads it, and the real all-MiniLM-L6-v2 as `python -m apmpo.models fetch` leaves it.

sentence-transformers is not installed (the module says why); its outputs for all-MiniLM-L6-v2 were compared once,
67 texts of 0 to 700 words: within 1.5e-8 (docs/evaluation.md). The per-row references here are the definitions.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apmpo import models
from apmpo.embeddings import EmbeddingModelError, SentenceEncoder, pool, pooling_modes

NAME = "all-minilm-l6-v2"


def naive_pool(hidden, mask, mode):
    """One row at a time, over the row's real tokens only."""
    rows = []
    for h, m in zip(hidden, mask):
        real = [h[t] for t in range(len(m)) if m[t] == 1]
        if mode == "cls":
            rows.append(real[0])
        elif mode == "lasttoken":
            rows.append(real[-1])
        elif mode == "max":
            rows.append(torch.tensor([max(float(v[d]) for v in real) for d in range(h.shape[1])], dtype=h.dtype))
        else:
            total = sum(real)
            rows.append(total / (len(real) if mode == "mean" else len(real) ** 0.5))
    return torch.stack(rows)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mode", ["cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken"])
def test_pool_equals_a_per_row_loop_over_real_tokens(mode, side):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 4, dtype=torch.float64) * 10
    lengths = [5, 2, 1]
    mask = torch.zeros(3, 5, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 5 - n:] = 1
    torch.testing.assert_close(pool(hidden, mask, (mode,)), naive_pool(hidden, mask, mode), rtol=0, atol=1e-12)


def test_several_modes_concatenate_in_order_and_a_hand_computed_mean():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding
    assert pool(hidden, mask, ("mean",)).tolist() == [[2.0, 4.0]]
    assert pool(hidden, mask, ("cls", "max", "lasttoken")).tolist() == [[1.0, 2.0, 3.0, 6.0, 3.0, 6.0]]


@pytest.mark.parametrize("config, modes", [
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, ("mean",)),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True, "pooling_mode_max_tokens": True},
     ("cls", "max", "mean")),  # the flags' order is sentence-transformers' concatenation order, not the file's
    ({"pooling_mode_mean_tokens": False}, ("mean",)),
    ({"embedding_dimension": 2560, "pooling_mode": "lasttoken"}, ("lasttoken",)),  # Qwen3-Embedding's
    ({"pooling_mode": ["max", "cls"]}, ("max", "cls")),
])
def test_pooling_config_reads_as_sentence_transformers_reads_it(config, modes):
    assert pooling_modes(config) == modes


def test_unsupported_pooling_or_modules_are_refused_by_name(tmp_path):
    with pytest.raises(EmbeddingModelError, match="pooling weightedmean"):
        pooling_modes({"pooling_mode_weightedmean_tokens": True})
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(EmbeddingModelError, match=r"modules \['Transformer', 'Pooling', 'Dense'\]"):
        SentenceEncoder(str(tmp_path))


# --- the real model ---


@pytest.fixture(scope="module")
def minilm():
    done = subprocess.run([sys.executable, "-m", "apmpo.models", "fetch", NAME], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path == models.model_dir(NAME)
    marker = json.loads((path / models.MARKER).read_text())
    assert marker["num_parameters"] == 22_713_216 and marker["check_cosine"] == 0.8406
    return SentenceEncoder(str(path))


def test_batched_embeddings_equal_each_text_alone_and_are_unit_norm(minilm):
    texts = ["A man is playing a guitar.", "x", "", "Tom has 3 apples and buys 5 more. " * 20, "Ünïcödé 中文 \\frac{1}{2}"]
    together = minilm(texts)
    alone = [minilm([text])[0] for text in texts]  # no padding at all
    for row, single in zip(together, alone):
        assert abs(row - single).max() < 1e-6
    assert abs((together ** 2).sum(axis=1) - 1).max() < 1e-6


def test_similar_sentences_are_closer_and_inputs_are_cut_at_256_word_pieces(minilm):
    guitar, plays, market = minilm(["A man is playing a guitar.", "Someone plays the guitar.",
                                    "The stock market fell today."])
    assert guitar @ plays > 0.8 > 0.1 > guitar @ market
    long = "seven plus eight " * 200  # 600 word pieces
    first, extended = minilm([long, long + "and a completely different ending about markets"])
    assert abs(first - extended).max() < 1e-6
    assert minilm.max_seq_length == 256


def test_a_second_fetch_does_nothing(minilm, tmp_path):
    marker = models.model_dir(NAME) / models.MARKER
    before = marker.stat().st_mtime_ns
    assert models.fetch(NAME, log=lambda message: pytest.fail(f"a second fetch logged {message!r}")) == \
        models.model_dir(NAME)
    assert marker.stat().st_mtime_ns == before


def test_a_fetch_replaces_a_damaged_entry(minilm, tmp_path, monkeypatch):
    """The remedy that a damaged cache's error names: the same fetch command, which fetches the entry anew."""
    import shutil

    fetched = models.fetch(NAME)
    monkeypatch.setenv("APMPO_CACHE", str(tmp_path))
    entry = models.model_dir(NAME)
    shutil.copytree(fetched, entry)
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"!")
    with pytest.raises(models.CacheError, match="sha256 differs"):
        models.resolve(NAME, verify=True)
    said = []
    assert models.fetch(NAME, log=said.append) == entry
    assert "model.safetensors's sha256 differs from the one the fetch wrote: fetching it again" in said[0]
    models.check_files(NAME, hashes=True)
