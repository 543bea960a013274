"""An environment module that ends the interpreter when it is imported, for tests/test_envs.py: a run that named it
ended with exit 7 and no message."""
import sys

sys.exit(7)
