"""The quickstart model is written atomically: a writer that dies part-way leaves no folder that a later run would
read as a model."""
import pytest
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from apmpo.config import Config
from apmpo.learner.prepare import prepare_model


def test_a_writer_that_dies_midway_leaves_no_model_and_the_next_run_writes_a_whole_one(tmp_path, monkeypatch):
    cfg = Config()
    cfg.model.path, cfg.logging.output_dir = "quickstart", str(tmp_path)
    model = cfg.run_dir / "model"

    def die(*args, **kwargs):  # a fake: the fault is a kill after the weights are written, before the tokenizer
        raise KeyboardInterrupt("killed while writing the tokenizer")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerFast, "save_pretrained", die)
        with pytest.raises(KeyboardInterrupt):
            prepare_model(cfg, is_main=True)
    assert not model.exists() and list(cfg.run_dir.iterdir()) == []
    # What a kill -9 leaves (no handler runs): a partial folder beside, with a config.json of 0 bytes.
    stale = cfg.run_dir / ".model.partial-x1"
    stale.mkdir()
    (stale / "config.json").write_text("")

    assert prepare_model(cfg, is_main=True) == str(model)
    assert AutoConfig.from_pretrained(model).model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(model).eos_token == "<|im_end|>"
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["model"]  # the partial folder was removed
