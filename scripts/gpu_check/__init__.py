"""The GPU check: what the learner side does on an NVIDIA GPU, measured with the project's own code.

    bash scripts/gpu_check.sh [--out gpu_check.json] [--only loss,transport]
    bash scripts/gpu_check.sh --dry-run      # the same code on CPU at tiny shapes; CI runs it (tests/test_gpu_check.py)

It prints one PASS/FAIL line per check and writes every figure, with the device, driver and library versions,
to `--out`. A check that fails prints its reason and the others still run; the exit code is 1 if any failed.
Goals are judged on the GPU only: a tiny CPU run says that the code works, not how fast it is.

The checks are functions of this package, a module per subject (learner.py, kernels.py, transport.py), beside what
they measure with (measure.py) and what the GPU machine lacks (wheels.py); run.py runs them by name and writes the
report, and `python -m scripts.gpu_check` (what gpu_check.sh runs, with the repository on PYTHONPATH) is its command.

Covered (nothing here needs vLLM, which the GPU box we borrow cannot carry):
- matmul_peak: a large matmul in the learner's dtype (bf16), the peak that MFU is measured against.
- learner_gc, learner_no_gc: Qwen2.5-1.5B's shape, randomly initialised, under DeepSpeed ZeRO-2 in bf16 with
  micro_batch_tokens 16384 with gradient checkpointing, 4096 without (16384 would not fit in 80 GB): one
  training step's learner part as launch/train.py runs it (`train_on_batch` of apmpo/learner/step.py: old and
  reference log-probs, then the optimiser step). Tokens/s, MFU and peak memory. MFU = 6 x parameters x tokens /
  update time / matmul peak (the LM head is counted for every token, though only completion tokens go through it,
  and the recomputed forward of checkpointing is not counted); `mfu_with_attention` adds causal attention's QK^T
  and AV products, 6 x layers x hidden x the sum of squared row lengths per step.
- loss: forward + backward of APMPO against GRPO at N=512 x T=2048, fp32 log-probs as the learner hands them
  (goal: APMPO <= 1.1x GRPO); torch.compile of the same call is measured beside it.
- logprobs: peak memory of chunked log-probs + entropy (apmpo.learner.logprobs) against the naive full
  log_softmax, at vocabulary 151,936 (goal <= 0.25x), and that both give the same log-probs.
- transport: weights sent with apmpo.rollout.weight_sync over CUDA IPC to a second process on the same GPU and
  received by the engine's receiving code (`receive_buckets`), checked bit for bit; bytes/s against a raw
  device-to-device copy of the same bytes. Then a LoRA adapter of that model (rank 16 on every linear layer of
  every block), received by the engine worker's own `apmpo_receive_adapter` into the file vLLM loads, which is
  read back and compared bit for bit. (--dry-run: shm, or gloo where /dev/shm is small.)
- learner_zero3: learner_gc under ZeRO-3 (train.zero_stage 3): on one GPU the weights are whole in one partition,
  so beside learner_gc it is the gathers' and hooks' cost and the memory they add, not ZeRO-3's saving.
- learner_fp32_comm: learner_gc with train.communication_data_type fp32 (ZeRO's reduce-scatter in fp32); on one
  GPU the figure is the casts' cost only, a multi-GPU run also sends twice the bytes.
- learner_fp16: learner_gc under model.dtype fp16 (DeepSpeed's fp16, dynamic loss scaling): tokens/s, peak memory,
  the loss scale, skipped steps (the scaler's search, reported) and the share of masters dithered on fp16's grid.
  (--dry-run: DeepSpeed's refusal of fp16 on a CPU without oneDNN fp16 is lifted for it, deepspeed_fp16_on_cpu.)
- precision_error: the learner's per-token log-prob error against an fp64 forward (fp32, bf16, bf16 + fp32 head,
  fp16; benchmarks/precision_error.py's functions) on the random Qwen2.5-1.5B-shaped model and random tokens.
- zero2_grads: ZeRO-2 gradients on one rank (DeepSpeed's fp32 partition, read with safe_get_full_grad) equal a
  plain torch backward of the same loss over two micro-batches: the learner's forwards call `engine.module` and
  rely on `engine.backward` to reduce at the boundary, which a DeepSpeed upgrade could break.
- transport also reports, on the GPU, the learner's reserved memory before a push (8 GiB of freed activations
  left cached) and its peak during it: send_buckets empties the cache before a CUDA IPC push.
- no_vllm: nothing the check imported pulled in vllm or apmpo.rollout.vllm_compat.
Not covered: anything of vLLM's (generation, the in-place reload of pushed weights, NCCL to a server).
"""
