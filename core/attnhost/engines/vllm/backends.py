"""The class-path host of attnhost's vLLM backends: ``attnhost.engines.vllm.backends.NAME`` is NAME's class.

vLLM resolves a backend from its enum value with ``resolve_obj_by_qualname``
(import the module, get the attribute), in whichever process needs it. The
module-level ``__getattr__`` builds the adapter class for a registered vLLM
name on first access, so a spawned worker gets the same class without any
registration step of its own.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from attnhost.engines.vllm.bridge import backend_class

    return backend_class(name)
