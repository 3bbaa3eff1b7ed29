"""relayrl: RL post-training of LLMs as a distributed dataflow."""

__version__ = "0.1.0"
