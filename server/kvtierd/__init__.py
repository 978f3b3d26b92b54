"""kvtierd: host-local KV-cache tier server for vLLM."""

__version__ = "0.1.0"
