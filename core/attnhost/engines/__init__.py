"""Engine bridges: attnhost's backends inside the serving engines users run.

Each bridge is the top layer of attnhost: it imports the core, never the
other way round, and it imports its engine only when that engine's own
plugin loader calls it (SGLang's ``sglang.srt.plugins`` group, vLLM's
``vllm.general_plugins``). Nothing here runs in a process without the
engine.
"""
