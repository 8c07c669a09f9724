"""DSDE Serve core: lossless batched speculative decoding with dynamic speculation length."""

__version__ = "0.1.0"
