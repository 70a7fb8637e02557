"""Foundations every layer uses, with no process group: flat layouts and their records,
precision policy and loss scaling, block quantization, the live-memory ledger, logging."""
