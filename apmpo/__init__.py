"""apmpo: Adaptive Power-Mean Policy Optimization for reinforcement learning from verifiable rewards."""

__version__ = "0.1.0"
