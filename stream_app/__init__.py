"""loopwarden: tells an AI agent's legitimate retry from runaway recursion, and stops the runaway."""

__version__ = "0.1.0"
