"""kvtier: client library for kvtierd (sync and asyncio clients, shared-memory pool access)."""

__version__ = "0.1.0"
