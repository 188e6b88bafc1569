"""Engine bridges: attnhost's backends inside the serving engines users run.

Each bridge is the top layer of attnhost: it imports the core, never the
other way round, and it imports its engine only when that engine's own
plugin loader calls it (SGLang's ``sglang.srt.plugins`` group, vLLM's
``vllm.general_plugins``). Nothing here runs in a process without the
engine.
"""

from __future__ import annotations

__all__ = ["require_engine"]


def require_engine(module: str, engine: str) -> None:
    """Refuse a bridge's entry point called in a process without its engine, in one sentence that says why."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        from attnhost.errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"attnhost.engines.{module}.register() is {engine}'s plugin hook, but {engine} is not installed; "
            f"install {module}, or do not call it (attnhost itself never does; {engine}'s plugin loader does)"
        )
