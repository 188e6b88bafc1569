"""``ServerArgs``: the immutable attention settings (a runner writing into shared args made the target run the
draft's backend: docs/architecture.md). Building the first one freezes the registry: its values were checked
against the choices, so the choices must not move."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, fields
from typing import Literal

from attnhost.errors import UnknownBackendError
from attnhost.host import default_host
from attnhost.registry import Registry

__all__ = ["KV_CACHE_DTYPES", "SPECULATIVE_ATTENTION_MODES", "ServerArgs"]

SPECULATIVE_ATTENTION_MODES: tuple[str, ...] = ("prefill", "decode")
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""SGLang's ``--kv-cache-dtype`` values and the cache dtype each selects (``auto``: the model's dtype)."""

_BACKEND_FLAGS = {
    "attention_backend": "the attention backend for prefill and decode; choices: {targets}",
    "prefill_attention_backend": "the attention backend for prefill (overrides --attention-backend); "
    "choices: {targets}",
    "decode_attention_backend": "the attention backend for decode (overrides --attention-backend); choices: {targets}",
    # any known name is accepted (one not draft-capable falls back, as in SGLang); the help offers the capable ones
    "speculative_draft_attention_backend": "the attention backend of the speculative draft model (default: inherit "
    "the target's prefill backend); draft-capable: {drafts}",
}
"""Field → its flag's help; backend names cannot hold braces, so ``str.format`` fills in the choices."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """SGLang's attention-related server arguments, with SGLang's names."""

    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    speculative_draft_attention_backend: str | None = None
    speculative_attention_mode: Literal["prefill", "decode"] = "prefill"
    kv_cache_dtype: str = "auto"
    """SGLang's ``--kv-cache-dtype``: ``auto`` (the model's dtype), ``fp8_e4m3`` or ``fp8_e5m2`` (docs/kv-cache.md)."""
    page_size: int = 1
    """SGLang's ``--page-size``: tokens per KV-cache page (1: token slots)."""

    def __post_init__(self) -> None:
        registry = default_host().freeze(by="the first ServerArgs")
        for name in _BACKEND_FLAGS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _canonical(registry, value, name))
        if self.speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
            raise ValueError(
                f"invalid speculative_attention_mode {self.speculative_attention_mode!r}; "
                f"choose from: {', '.join(SPECULATIVE_ATTENTION_MODES)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"invalid kv_cache_dtype {self.kv_cache_dtype!r}; choose from: {', '.join(KV_CACHE_DTYPES)}"
            )
        page = self.page_size
        if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
            raise ValueError(f"invalid page_size {page!r}; it is a positive number of tokens per page (1: slots)")

    def get_attention_backends(self) -> tuple[str | None, str | None]:
        """``(prefill, decode)``: the specific flag if given, else ``attention_backend``."""
        return (
            self.prefill_attention_backend or self.attention_backend,
            self.decode_attention_backend or self.attention_backend,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add SGLang's attention flags, their choices from every installed plugin; the parser holds a copy of
        them, so this freezes the registry (a later registration raises instead of the parser rejecting it)."""
        registry = default_host().freeze(by="ServerArgs.add_cli_args(parser)")
        targets = _offer(registry, registry.names())
        drafts = _offer(registry, registry.names("draft")) or "none"
        group = parser.add_argument_group("attention backends")
        for name, help_text in _BACKEND_FLAGS.items():
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=functools.partial(_canonical, registry),
                choices=registry.names(),
                default=None,
                metavar="NAME",
                help=help_text.format(targets=targets, drafts=drafts).replace("%", "%%"),
            )
        group.add_argument(
            "--speculative-attention-mode",
            dest="speculative_attention_mode",
            choices=SPECULATIVE_ATTENTION_MODES,
            default="prefill",
            help="which backend verifies draft tokens: the prefill or the decode one (default: %(default)s)",
        )
        cache = parser.add_argument_group("KV cache")
        cache.add_argument(
            "--kv-cache-dtype",
            dest="kv_cache_dtype",
            choices=tuple(KV_CACHE_DTYPES),
            default="auto",
            help="the KV cache's dtype: auto (the model's) or FP8 with per-layer scales (default: %(default)s)",
        )
        cache.add_argument(
            "--page-size",
            dest="page_size",
            type=int,
            default=1,
            help="tokens per KV-cache page; a backend may declare the page sizes it reads (default: %(default)s)",
        )

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> ServerArgs:
        """Build from a namespace parsed with a parser that ``add_cli_args`` set up."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)})


def _offer(registry: Registry, names: tuple[str, ...]) -> str:
    """``flashinfer, dsa (alias nsa), ...``: the names a flag accepts, each with its aliases."""
    aliases: dict[str, list[str]] = {}
    for alias, canonical in registry.aliases().items():
        aliases.setdefault(canonical, []).append(alias)
    return ", ".join(f"{name} (alias {', '.join(aliases[name])})" if name in aliases else name for name in names)


def _canonical(registry: Registry, value: object, field_name: str | None = None) -> str:
    """``value``'s canonical name; unknown, it is refused for the field, or for argparse (no field given)."""
    canonical = registry.canonical(value) if isinstance(value, str) else None
    if canonical is not None:
        return canonical
    if field_name is None:
        raise argparse.ArgumentTypeError(registry.unknown_message(value))
    raise UnknownBackendError(f"{field_name}: {registry.unknown_message(value)}")
