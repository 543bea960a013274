"""Compare methods over seeds: `python -m apmpo.study` trains every (method, seed), evaluates each run's last and
best-by-validation policies with `python -m apmpo.eval`, and reports the differences with bootstrap intervals
(apmpo/study/report.py). docs/study.md has the commands and the first result."""
