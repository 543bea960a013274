"""Generation: a vLLM engine behind HTTP, and what the learner uses to reach it.

- The server process (`python -m apmpo.rollout.server`): `server.py` (the HTTP routes), `engine.py` (the engine and
  its state), `vllm_compat.py` (every use of vLLM), `no_torchvision.py`.
- The learner and `python -m apmpo.eval`: `client.py` (`GenerationClient`), `pool.py` (several servers as one),
  `launcher.py` (starts and stops servers).
- Both sides: `weight_sync.py` (the learner→engine weight transport, with the extension mixed into the engine's
  workers), `net.py` (addresses, ports, threads). `Sampling` (how a sample is drawn, checked alike on both sides)
  lives on the ground floor, `apmpo/sampling.py`, since the config holds one.
"""
from apmpo.rollout.client import GenerationClient, PushReport, Sample, ServerError, ServerUnavailable
from apmpo.sampling import Sampling

__all__ = ["GenerationClient", "PushReport", "Sample", "Sampling", "ServerError", "ServerUnavailable"]
