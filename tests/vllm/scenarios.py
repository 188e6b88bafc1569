"""One vLLM process per scenario (vLLM loads its general plugins once per process): run, report JSON.

``python scenarios.py NAME`` runs vLLM's own ``load_general_plugins()`` under
whatever environment the test set, then prints one ``RESULT: {...}`` line
describing what vLLM's registry holds and what attnhost logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

OURS = ("TORCH_NATIVE", "TINY", "BATCHED_MATMUL", "FLEX_ATTENTION", "ATTNHOST_FLEX_ATTENTION")

CLASH_PLUGIN = {
    "acme_flex": """
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="flex_attention", factory="acme_flex.backend:FlexLike", requires=("torch",),
                        description="a plugin implementing a name vLLM already has")]
""",
    "acme_flex.backend": """
from attnhost import BackendCapabilities
from attnhost_tiny import TinyAttnBackend


class FlexLike(TinyAttnBackend):
    capabilities = BackendCapabilities(dtypes=("float16", "bfloat16"), head_dims=(64, 128))
""",
}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def main() -> None:
    records = Records()
    logging.getLogger("attnhost").addHandler(records)
    logging.getLogger("attnhost").setLevel(logging.INFO)
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    members = AttentionBackendEnum.__members__

    def path(name: str) -> str:
        return str(_ATTN_OVERRIDES.get(members[name], members[name].value) or "")

    result: dict[str, object] = {
        "attnhost_imported": "attnhost" in sys.modules,
        "registered": sorted(name for name in members if path(name).startswith("attnhost.")),
        "paths": {name: path(name) for name in OURS if name in members},
        "log": records.lines,
        "has": {
            name: name in members for name in ("FA3", "ATTNHOST_FLASHINFER", "FLASHINFER", "ATTNHOST_TORCH_NATIVE")
        },
    }
    if "ATTNHOST_FLEX_ATTENTION" in members or os.environ.get("ATTNHOST_VLLM_OVERRIDE") == "flex_attention":
        import torch
        from selector import selector_reasons
        from vllm.config import AttentionConfig

        name = "FLEX_ATTENTION" if os.environ.get("ATTNHOST_VLLM_OVERRIDE") else "ATTNHOST_FLEX_ATTENTION"
        cls = members[name].get_class()
        selected = AttentionConfig(backend=name.lower()).backend

        def reasons(head_size: int, dtype: torch.dtype) -> list[str]:
            return selector_reasons(cls, head_size=head_size, dtype=dtype)

        result["adapter"] = {
            "selected": selected.name if selected is not None else None,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "attnhost_name": cls.identity.attnhost_name,
            "dtypes": [str(d) for d in cls.supported_dtypes],
            "kv_dtypes": cls.supported_kv_cache_dtypes,
            "head_sizes": cls.get_supported_head_sizes(),
            "ok": reasons(128, torch.bfloat16),
            "bad": reasons(32, torch.float32),
        }
    if os.environ.get("SCENARIO_HELP"):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        result["help"] = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).format_help()
    print("RESULT: " + json.dumps(result))


if __name__ == "__main__":
    main()
