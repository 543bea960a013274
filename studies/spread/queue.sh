#!/usr/bin/env bash
# Where the seed's spread comes from (issue 53, docs/study.md "Where the spread comes from"): GRPO runs of
# configs/smollm2_arith.yaml that differ from the study's seed-0 run (train.seed = data.seed = 0) in one thing,
# evaluated as the study evaluates (python -m apmpo.eval, 96 problems x 16 samples, eval seed 0), and two 15-step
# reruns of the study's seed-0 APMPO and GRPO runs that log each completion's digest (rollouts.jsonl): does a rerun
# repeat the study's run, and at which step do the two methods' coupled trajectories part?
#   bash studies/spread/queue.sh          # skips what is done; kill it and run it again to go on
# train.seed sets the engine's sampling seeds and the learner's torch seed; data.seed the prompts' order.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
OUT=studies/spread/runs
run() {  # NAME STEPS EVAL_SEEDS OVERRIDES...
  local name=$1 steps=$2 seeds=$3; shift 3
  local dir=$OUT/$name sets=()
  for o in "$@" "train.steps=$steps" "logging.output_dir=$OUT" "logging.run_name=$name" "train.resume=auto" \
           "checkpoint.save_every=10" "checkpoint.keep_last=1"; do sets+=(--set "$o"); done
  if [[ ! -f $dir/checkpoints/step_$steps/trainer_state.json ]]; then
    echo "[spread] $name: training"
    $PY launch/train.py --config configs/smollm2_arith.yaml "${sets[@]}" > "$OUT/$name.log" 2>&1 &
    wait $! || { echo "[spread] $name failed"; return 1; }
  fi
  [[ -z $seeds || -f $dir/eval/last/results.json ]] && return 0
  echo "[spread] $name: eval"
  $PY -m apmpo.eval --model "$dir/checkpoints/step_$steps" --benchmarks arith_test \
    --out "$dir/eval/last" --label "$name last" --n 16 --seeds "$seeds" --temperature 0.7 --top-p 1.0 \
    --max-tokens 128 --max-model-len 256 --reward-workers 1 --reward-timeout-s 10 --enforce-eager \
    >> "$OUT/$name.log" 2>&1 &
  wait $! || { echo "[spread] $name eval failed"; return 1; }
}
mkdir -p $OUT
# Each run goes in the background and is waited for, so that a TERM or INT to the queue reaches it at once: a plain
# `python launch/train.py` follows no parent (it may be nohup's), and a killed queue left its run training.
trap 'kill $(jobs -p) 2>/dev/null; exit 143' TERM INT
extend() {  # FROM TO: a copy of a finished shorter run, to go on from its last checkpoint (a resume is exact);
  # without the shorter run's evaluation, which would stand for the longer one's
  [[ -d $OUT/$2 || ! -d $OUT/$1 ]] || { cp -r "$OUT/$1" "$OUT/$2" && rm -rf "$OUT/$2/eval"; }
}
# The study's seed-0 runs predate the engines' inverse-CDF sampling and hashed seeds (docs/study.md): they share
# their prompts with these runs, not their sampling numbers. So the reference cell is run again (grpo_t0_d0), and
# the rerun that checks determinism repeats a run made after those changes: the study's GRPO seed 3.
# The decomposition first (sampling noise against prompt order), then the plateau (it decides the design: item 2),
# then the second pair, more replicates and the rerun's tail.
run grpo_t0_d0_15 15 "" loss.name=grpo train.seed=0 data.seed=0
run apmpo_t0_d0_15 15 "" loss.name=apmpo train.seed=0 data.seed=0
extend grpo_t0_d0_15 grpo_t0_d0 && run grpo_t0_d0 30 0,1 loss.name=grpo train.seed=0 data.seed=0
run grpo_t1_d0 30 0 loss.name=grpo train.seed=1 data.seed=0
# The plateau: do runs that differ only in their sampling noise (train.seed) agree more at step 60 than at step 30?
# The learning rate is constant after its warm-up, so the first 30 steps of a 60-step run are the 30-step run: each
# goes on from its step-30 checkpoint (a resume is exact).
plateau() { extend grpo_t${1}_d0 grpo_t${1}_d0_60 && run grpo_t${1}_d0_60 60 0 loss.name=grpo train.seed=$1 data.seed=0; }
plateau 0
plateau 1
run grpo_t0_d1 30 0 loss.name=grpo train.seed=0 data.seed=1
extend apmpo_t0_d0_15 apmpo_t0_d0 && run apmpo_t0_d0 30 0 loss.name=apmpo train.seed=0 data.seed=0
run grpo_t2_d0 30 0 loss.name=grpo train.seed=2 data.seed=0
plateau 2
run grpo_t0_d2 30 0 loss.name=grpo train.seed=0 data.seed=2
run grpo_t3_d3_15 15 "" loss.name=grpo train.seed=3 data.seed=3
echo "[spread] queue done"
