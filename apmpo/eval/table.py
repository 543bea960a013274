"""Markdown tables from results.json, laid out like the paper's: Table 1 (math), the SQL / Geometry3K table and
the diversity table, one row per evaluation.

    python -m apmpo.eval.table runs/eval/base runs/eval/grpo runs/eval/apmpo [--labels Base,GRPO,APMPO] [--out t.md]

Cells are percentages, mean ± std over the eval seeds (the std is left out with one seed); "a / b" is Pass@1 /
Pass@16 (the largest k asked for). `python -m apmpo.eval` writes the same tables for its one model to
DIR/results.md, with a detail table per benchmark below them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from apmpo.eval.metrics import MATH_SIX, PASS_AT_K_BENCHMARKS

TITLES = {"math500": "MATH500", "aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "minerva": "Minerva",
          "olympiadbench": "Olympiad", "spider": "Spider", "bird": "BIRD", "geometry3k": "Geometry3K"}


def cell(metric: dict | None, scale: float = 100.0, digits: int = 1) -> str:
    if not metric:
        return "–"
    text = f"{metric['mean'] * scale:.{digits}f}"
    return text + (f" ± {metric['std'] * scale:.{digits}f}" if len(metric["per_seed"]) > 1 else "")


def _k_max(results: dict) -> int | None:
    ks = [k for k in results["settings"]["k"] if k > 1]
    return max(ks) if ks else None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def math_table(runs: list[tuple[str, dict]]) -> list[str]:
    present = [b for b in MATH_SIX if any(b in r["benchmarks"] for _, r in runs)]
    if not present:
        return []
    k = max((_k_max(r) or 0 for _, r in runs), default=0)
    header = ["Model"] + [TITLES[b] for b in present] + ["Avg."]
    rows = []
    for label, results in runs:
        row = [label]
        for name in present:
            bench = results["benchmarks"].get(name)
            text = cell(bench and bench["pass@1"])
            if name in PASS_AT_K_BENCHMARKS and k > 1:
                text += " / " + cell(bench and bench.get(f"pass@{k}"))
            row.append(text)
        avg = results.get("average") or {}
        row.append(cell(avg.get("pass@1")) + (" / " + cell(avg.get(f"pass@{k}")) if k > 1 else ""))
        rows.append(row)
    three = ", ".join(TITLES[b] for b in PASS_AT_K_BENCHMARKS if b in present)
    note = (f"{three}: Pass@1 / Pass@{k}. Avg.: mean Pass@1 over the math benchmarks shown / mean Pass@{k} over "
            f"{three}." if k > 1 and three else "Pass@1; Avg.: its mean over the math benchmarks shown.")
    return _table(header, rows) + ["", note]


def other_table(runs: list[tuple[str, dict]]) -> list[str]:
    names = list(dict.fromkeys(b for _, r in runs for b in r["benchmarks"] if b not in MATH_SIX))
    if not names:
        return []
    rows = [[label] + [cell((r["benchmarks"].get(b) or {}).get("pass@1")) for b in names] for label, r in runs]
    return _table(["Model"] + [TITLES.get(b, b) for b in names], rows) + ["", "Pass@1 (SQL: execution accuracy)."]


def diversity_table(runs: list[tuple[str, dict]]) -> list[str]:
    rows = []
    for label, results in runs:
        d = results.get("diversity")
        if d:
            judge = (d.get("judge") or {}).get("score")
            rows.append([label, f"{d['acs']:.2f}", f"{d['self_bleu']:.2f}", "–" if judge is None else f"{judge:.2f}"])
    if not rows:
        return []
    d = next(r["diversity"] for _, r in runs if r.get("diversity"))
    return _table(["Model", "ACS ↓", "Self-BLEU ↓", "LLM judge ↑"], rows) + [
        "", f"MATH500, {d['samples_per_prompt']} samples per prompt over {d['num_prompts']} prompts; "
            f"embeddings: {d['embedding_model']}."]


def detail_table(results: dict) -> list[str]:
    ks = results["settings"]["k"]
    header = ["Benchmark", "Task", "Problems", "Samples", *[f"Pass@{k}" for k in ks], "Correct", "Mean tokens",
              "Truncated"]
    rows = [[name, b["task"], str(b["num_problems"]), f"{b['n']} × {len(b['seeds'])} seeds",
             *[cell(b.get(f"pass@{k}")) for k in ks], f"{b['num_correct']} / {b['num_samples']}",
             f"{b['mean_tokens']:.0f}", f"{100 * b['truncated_frac']:.1f}%"]
            for name, b in results["benchmarks"].items()]
    return _table(header, rows)


def settings_line(results: dict) -> str:
    s = results["settings"]
    return (f"Sampling: temperature {s['temperature']}, top-p {s['top_p']}, up to {s['max_tokens']} new tokens, "
            f"n = {s['n']} samples per problem, seeds {', '.join(map(str, s['seeds']))}"
            + (f", first {s['limit']} problems per benchmark" if s.get("limit") else "")
            + ". Cells: %, mean ± std over seeds.")


def render(runs: list[tuple[str, dict]], detail: bool = False) -> str:
    lines = [settings_line(runs[0][1]), ""]
    differ = [label for label, r in runs[1:] if settings_line(r) != lines[0]]
    if differ:
        lines[0] = f"{runs[0][0]}: {lines[0]} Other settings in: {', '.join(differ)} (see their results.json)."
    for block in (math_table(runs), other_table(runs), diversity_table(runs)):
        if block:
            lines += block + [""]
    if detail:
        lines += ["Per benchmark:", ""] + detail_table(runs[0][1]) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apmpo.eval.table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="output directories of python -m apmpo.eval")
    parser.add_argument("--labels", help="comma-separated row labels (default: each results.json's label)")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: stdout)")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.dirs):
        parser.error(f"{len(labels)} labels for {len(args.dirs)} directories")
    runs = []
    for i, directory in enumerate(args.dirs):
        path = directory / "results.json"
        if not path.is_file():
            parser.error(f"{path} not found (run python -m apmpo.eval --out {directory} first)")
        results = json.loads(path.read_text())
        runs.append((labels[i] if labels else results["label"], results))
    text = render(runs)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
