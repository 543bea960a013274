"""Evaluation as in the paper: `python -m apmpo.eval` (see __main__.py), `python -m apmpo.eval.table`.

| module | owns |
|---|---|
| `metrics.py` | the unbiased Pass@k estimator, per-benchmark and average scores (mean ± std over seeds) |
| `run.py` | benchmarks (built-in, local files, hub ids), the resumable samples.jsonl, generation and scoring |
| `validate.py` | validation during training (`eval:` config): the CLI's functions on the server's current weights |
| `diversity.py` | Self-BLEU, ACS and the LLM judge of the paper's diversity appendix |
| `table.py` | the markdown tables (Table 1 layout), also across several output directories |

Scoring reuses `apmpo.rewards` through the same `RewardPool` as training, so a sample counts as correct exactly
when training would have rewarded it.
"""
from apmpo.eval.metrics import average, pass_at_k, summarize_benchmark

__all__ = ["average", "pass_at_k", "summarize_benchmark"]
