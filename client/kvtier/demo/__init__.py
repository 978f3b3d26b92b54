"""The main job, `make demo`: kvtierd and two real vLLM engines sharing a prompt prefix.

Also holds what the demo and the end-to-end tests share: a tiny local model maker and a runner
that drives one vLLM engine in its own process.
"""
