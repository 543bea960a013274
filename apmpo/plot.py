"""Training dynamics of one or more runs in one figure, like the paper's Figure 1: one colour per run.

    python -m apmpo.plot runs/apmpo runs/grpo --out dynamics.png [--labels APMPO,GRPO] [--smooth 0.9]

Panels, against the training step: (a) training reward, (b) policy entropy, (c) cumulative wall-clock time of
the steps (the sum of `time/step`: start-up and checkpoint writes excluded), (d) APMPO's power p, (e) its
adaptive upper clip eps_ada, (f) the feedback stability score FSS = mu_R / (sigma_R + delta), and, for runs that
validate (`eval:` config), one more panel per benchmark with its `val/<benchmark>/pass@1` at each validation
(points joined, not smoothed). Thin lines are the
raw per-step values, thick ones their exponential moving average (`--smooth`, debiased as TensorBoard's; 0 turns
it off). A RUN_DIR holds metrics.jsonl (runs/<name>/, as launch/train.py writes it); the metrics.jsonl file
itself may be passed. Legend labels: `--labels`, else the run directories' names, made distinct with the loss
name from config.yaml or the parent folder.

Several runs per label (seeds): runs given the same label are drawn as one line, their mean at each step (a run
that skipped a step holds its last value), with a band from their minimum to their maximum (the paper's Figure 1
over seeds). A study folder (`python -m apmpo.study --out DIR`) stands for all its runs, labelled by method:

    python -m apmpo.plot studies/smollm2_arith --out curves.png
    python -m apmpo.plot runs/a0 runs/a1 runs/g0 runs/g1 --labels APMPO,APMPO,GRPO,GRPO
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path

PANELS = [  # (metric key, title, y label)
    ("reward/mean", "(a) Training reward", "mean reward"),
    ("policy/entropy", "(b) Policy entropy", "entropy (nats / token)"),
    ("time/step", "(c) Wall-clock training time", "cumulative time"),
    ("apmpo/p", "(d) Power p", "p"),
    ("apmpo/eps_ada", "(e) Adaptive upper clip ε_ada", "ε_ada"),
    ("apmpo/fss", "(f) Feedback stability score", "FSS = μ / (σ + δ)"),
]


def read_metrics(run: Path) -> dict[int, dict]:
    """{step: metrics} of a run directory (or its metrics.jsonl); a repeated step keeps its last line."""
    path = run if run.is_file() else run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run}")
    steps = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and "step" in row:
            steps[int(row["step"])] = row
    if not steps:
        raise ValueError(f"{path} holds no steps yet")
    return dict(sorted(steps.items()))


def series(metrics: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`, skipping steps where it is missing or not finite."""
    points = [(s, float(m[key])) for s, m in metrics.items() if isinstance(m.get(key), (int, float))]
    points = [(s, v) for s, v in points if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average, debiased so that the first points are not pulled towards zero."""
    out, avg = [], 0.0
    for i, value in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight**i) if weight > 0 else value)
    return out


def smoothed(values: list[float], weight: float, log_like: bool = False) -> list[float]:
    """The EMA; `log_like` averages asinh(values) instead, so that one huge value (FSS when a batch's rewards are
    all equal: sigma = 0) shows as a bump rather than flattening a hundred steps after it."""
    if not log_like:
        return ema(values, weight)
    return [math.sinh(v) for v in ema([math.asinh(v) for v in values], weight)]


def validation_panels(data: list[dict[int, dict]]) -> list[tuple[str, str, str]]:
    """A panel per validated benchmark, in the order first logged: (key, title, y label)."""
    keys = dict.fromkeys(k for metrics in data for row in metrics.values() for k in row
                         if k.startswith("val/") and k.endswith("/pass@1"))
    letters = "ghijklmnopqrstuvwxyz"
    return [(key, f"({letters[i % len(letters)]}) Validation: {key[4:-7]}", "pass@1") for i, key in enumerate(keys)]


def run_labels(runs: list[Path]) -> list[str]:
    dirs = [run.parent if run.is_file() else run for run in runs]
    labels = [d.resolve().name for d in dirs]
    if len(set(labels)) == len(labels):
        return labels
    losses = [_loss_name(d) for d in dirs]
    with_loss = [f"{label} ({loss})" if loss else label for label, loss in zip(labels, losses)]
    if len(set(with_loss)) == len(with_loss):
        return with_loss
    return [f"{d.resolve().parent.name}/{d.resolve().name}" for d in dirs]


def _loss_name(run_dir: Path) -> str | None:
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    import yaml  # noqa: PLC0415

    loss = (yaml.safe_load(config.read_text()) or {}).get("loss") or {}
    return loss.get("name") if isinstance(loss, dict) else None


def panel_series(metrics: dict[int, dict], key: str, smooth: float) -> tuple[list[int], list[float]]:
    """What a panel draws of one run: the cumulative sum of time/step, validation points as they are, and the
    smoothed values of every other metric."""
    steps, values = series(metrics, key)
    if key == "time/step":
        return steps, [sum(values[:i + 1]) for i in range(len(values))]
    if key.startswith("val/"):
        return steps, values
    return steps, smoothed(values, smooth, log_like=key == "apmpo/fss")


def band(curves: list[tuple[list[int], list[float]]], end: int, scale: float = 1.0):
    """The mean, minimum and maximum over the curves (divided by `scale`) at every step any of them logged, from
    the first step all of them have begun to `end` (the last step every run reached). A curve that skipped a step
    (an APMPO step whose every group scored alike logs no p) holds its last value there, as its moving average
    does: one quiet seed does not cut the line short."""
    start = max(steps[0] for steps, _ in curves)
    steps = sorted({s for curve_steps, _ in curves for s in curve_steps if start <= s <= end})
    columns = [[values[bisect.bisect_right(curve_steps, s) - 1] / scale for curve_steps, values in curves]
               for s in steps]
    return steps, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def expand_studies(paths: list[Path]) -> tuple[list[Path], list[str] | None]:
    """A study folder (with study.json) stands for its runs (runs/METHOD/seed_S), labelled by method; other paths
    stay as they are. Returns the runs, and their labels when a study was given."""
    runs, labels, any_study = [], [], False
    for path in paths:
        if (path / "study.json").is_file():
            any_study = True
            found = sorted(p.parent for p in path.glob("runs/*/seed_*/metrics.jsonl"))
            if not found:
                raise FileNotFoundError(f"the study {path} has no run with metrics.jsonl yet")
            runs += found
            labels += [p.parent.name for p in found]
        else:
            runs.append(path)
            labels.append(None)
    if not any_study:
        return runs, None
    names = iter(run_labels([r for r, label in zip(runs, labels) if label is None]))
    return runs, [label if label is not None else next(names) for label in labels]


def time_scale(seconds: float) -> tuple[float, str]:
    return (1.0, "s") if seconds < 180 else (60.0, "min") if seconds < 3 * 3600 else (3600.0, "h")


def plot(runs: list[Path], out: Path, labels: list[str] | None = None, smooth: float = 0.9,
         title: str | None = None, dpi: int = 130) -> Path:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs, study_labels = expand_studies(runs)
    data = [read_metrics(run) for run in runs]
    if labels and len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    labels = labels or study_labels or run_labels(runs)
    groups: dict[str, list[dict[int, dict]]] = {}
    for label, metrics in zip(labels, data):
        groups.setdefault(label, []).append(metrics)
    colors = plt.get_cmap("tab10").colors
    styles = ("-", "--", ":", "-.")  # past ten labels the colours repeat: the line style tells them apart

    def look(i: int) -> dict:
        return dict(color=colors[i % len(colors)], linestyle=styles[i // len(colors) % len(styles)])

    total_time = max((sum(series(m, "time/step")[1]) for m in data), default=0.0)
    scale, unit = time_scale(total_time)

    panels = PANELS + validation_panels(data)
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4.2 * rows), constrained_layout=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, panel_title, ylabel) in zip(axes.flat, panels):
        drawn = False
        for i, members in enumerate(groups.values()):
            color = look(i)["color"]
            curves = [panel_series(metrics, key, smooth) for metrics in members]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            if key == "time/step":
                ylabel = f"cumulative time ({unit})"
            steps, mean, low, high = band(curves, end=min(max(metrics) for metrics in members),
                                          scale=scale if key == "time/step" else 1.0)
            marker = dict(marker="o", markersize=4) if key.startswith("val/") else {}
            if len(curves) > 1:
                ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
            elif key not in ("time/step",) and not key.startswith("val/"):
                raw_steps, raw = series(members[0], key)
                ax.plot(raw_steps, raw, color=color, linewidth=0.8, alpha=0.35)
            ax.plot(steps, mean, linewidth=2.2, **look(i), **marker)
            drawn = True
        if key == "apmpo/fss" and drawn and ax.dataLim.y1 > 100:  # what is drawn: moving averages may stay low
            ax.set_yscale("symlog", linthresh=10)  # FSS explodes when a batch's rewards barely vary
        if not drawn:
            ax.text(0.5, 0.5, f"{key} not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(panel_title, fontsize=13)
        ax.set_xlabel("step", fontsize=11)
        ax.set_ylabel(ylabel, fontsize=11)
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    labels = [f"{label} ({len(members)} runs)" if len(members) > 1 else label for label, members in groups.items()]
    handles = [plt.Line2D([], [], linewidth=2.5, **look(i)) for i in range(len(labels))]
    # below the panels when a title takes the top: constrained layout does not stack a suptitle and a legend there
    fig.legend(handles, labels, loc="outside lower center" if title else "outside upper center",
               ncol=min(len(labels), 6), fontsize=12, frameon=False)
    if title:
        fig.suptitle(title, fontsize=14)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apmpo.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories (runs/<name>) or study folders")
    parser.add_argument("--out", type=Path, default=Path("dynamics.png"), help="image file (.png, .pdf, .svg)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per run")
    parser.add_argument("--smooth", type=float, default=0.9, help="EMA weight in [0, 1): 0 = no smoothing")
    parser.add_argument("--title", default=None)
    parser.add_argument("--dpi", type=int, default=130)
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if not 0 <= args.smooth < 1:
        parser.error("--smooth must lie in [0, 1)")
    try:
        out = plot(args.runs, args.out, labels, args.smooth, args.title, args.dpi)
    except (FileNotFoundError, ValueError) as error:
        print(f"apmpo.plot: error: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
