"""Generation: the vLLM server (`python -m apmpo.rollout.server`), its client, and learner→server weight sync."""
from apmpo.rollout.client import GenerationClient, Sample, ServerError, ServerUnavailable

__all__ = ["GenerationClient", "Sample", "ServerError", "ServerUnavailable"]
