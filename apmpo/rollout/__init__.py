"""Generation: the vLLM server (`python -m apmpo.rollout.server`), its client, and learner→server weight sync."""
from apmpo.rollout.client import GenerationClient, PushReport, Sample, ServerError, ServerUnavailable
from apmpo.rollout.sampling import Sampling

__all__ = ["GenerationClient", "PushReport", "Sample", "Sampling", "ServerError", "ServerUnavailable"]
