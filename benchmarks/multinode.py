"""The cost of a second node, in tests/test_multinode.py's setting: the quickstart with two learner ranks on one host
(both in node A's network namespace, gloo over loopback) against one rank on each of two nodes (network namespaces
joined by a veth pair, gloo over eth1), side by side. Then where the difference goes: ZeRO-2 reduces every gradient
across the ranks each optimiser step, fp32 on CPU; the same bytes are all-reduced alone over each link.

    sudo .venv/bin/python benchmarks/multinode.py [--steps 6]

Root only (network namespaces). Times are medians over the steps after the first; run it on an idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402
from test_multinode import HOSTFILE, MASTER_ADDR, MASTER_PORT, node_command  # noqa: E402

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def train(nodes: netns.TwoNodes, out: Path, two_nodes: bool, steps: int) -> list[dict]:
    """The quickstart for `steps` steps; its metrics. One host: `deepspeed --num_gpus 2` in node A."""
    (out / "runs").mkdir(parents=True)
    sets = [f"train.steps={steps}", "checkpoint.save_every=0", "eval.every=0", "rollout.num_servers=1",
            f"logging.output_dir={out / 'runs'}"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": netns.INTERFACE}
    if two_nodes:
        hostfile = out / "hostfile"
        hostfile.write_text(HOSTFILE)
        commands = [nodes.run_in(node) + node_command(hostfile, node, *sets) for node in (0, 1)]
    else:
        commands = [nodes.run_in(0) + [DEEPSPEED, "--num_gpus", "2", "--master_port", str(MASTER_PORT),
                                       "launch/train.py", "--config", "configs/quickstart.yaml",
                                       *(a for s in sets for a in ("--set", s))]]
        env.pop("GLOO_SOCKET_IFNAME")  # loopback, as on one machine
    processes = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for c in commands]
    errors = [p.communicate()[1] for p in processes]
    nodes.kill_all(0), nodes.kill_all(1)
    if any(p.returncode for p in processes):
        raise SystemExit("a run failed:\n" + "\n".join(e[-3000:] for e in errors))
    return [json.loads(line) for line in (out / "runs/quickstart/metrics.jsonl").read_text().splitlines()]


def all_reduce(nodes: netns.TwoNodes, two_nodes: bool, numel: int, repeats: int) -> float:
    """Median seconds of a gloo all-reduce of `numel` fp32 values between two ranks."""
    master = MASTER_ADDR if two_nodes else "127.0.0.1"
    env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": str(MASTER_PORT + 1), "WORLD_SIZE": "2"}
    if two_nodes:
        env["GLOO_SOCKET_IFNAME"] = netns.INTERFACE
    processes = [subprocess.Popen(
        nodes.run_in(rank if two_nodes else 0) + [sys.executable, __file__, "--worker", str(numel), str(repeats)],
        env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    return float(processes[0].communicate()[0].split()[-1]) if not processes[1].wait() else float("nan")


def worker(numel: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    grads = torch.ones(numel)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        tick = time.perf_counter()
        dist.all_reduce(grads)
        times.append(time.perf_counter() - tick)
    dist.destroy_process_group()
    print(statistics.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if why := netns.unusable():
        raise SystemExit(why)
    from safetensors import safe_open

    rows = {}
    with netns.TwoNodes() as nodes, tempfile.TemporaryDirectory() as tmp:
        for name, two in (("one host", False), ("two nodes", True)):
            records = train(nodes, Path(tmp) / name.replace(" ", "_"), two, args.steps)[1:]
            model = Path(tmp) / name.replace(" ", "_") / "runs/quickstart/model/model.safetensors"
            with safe_open(model, "pt") as f:
                numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
            rows[name] = {key: statistics.median(r[key] for r in records)
                          for key in ("time/step", "time/update", "time/logprob", "time/weight_sync")}
            rows[name]["all_reduce"] = all_reduce(nodes, two, numel, args.repeats)
    print(f"quickstart, 2 learner ranks, medians of steps 2-{args.steps}; gradients: {numel} fp32 values = "
          f"{numel * 4 / 2**20:.2f} MiB all-reduced per optimiser step")
    print(f"{'':22}{'one host':>12}{'two nodes':>12}")
    for key in ("time/step", "time/update", "time/logprob", "time/weight_sync", "all_reduce"):
        print(f"{key + ' (s)':22}{rows['one host'][key]:12.4f}{rows['two nodes'][key]:12.4f}")
    one, two = rows["one host"], rows["two nodes"]
    print(f"ratio two nodes/one host: step {two['time/step'] / one['time/step']:.2f}x, "
          f"all-reduce {two['all_reduce'] / one['all_reduce']:.2f}x")


if __name__ == "__main__":
    main()
