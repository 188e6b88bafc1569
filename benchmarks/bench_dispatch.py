"""Per-forward dispatch: ``dispatch_attention_backend(mode)`` against what the SGLang seed does per call.

The seed (SGLang after #28559) decides the backend inside every attention
call: it reads the global server args, computes their ``(prefill, decode)``
pair, reads the current backend's stamped ``prefill_attention_backend_str`` /
``decode_attention_backend_str`` (falling back to that pair), walks the
forward-mode predicate chain of ``dispatch_attn_forward_method``, and looks
the handler up in a registry dict. ``_seed_dispatch`` below does exactly
that, with attnhost's ``ForwardMode`` (same predicates as SGLang's).

attnhost precomputes the per-mode answer when a runner enters its forward
context, so a call is one ``ContextVar.get`` and one tuple index. Both are
measured in the same loop, on the same modes, in nanoseconds per call
(the loop's own cost included on both sides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _common import Row, interleaved, per_call


class _SeedArgs:
    """The global server args object the seed reads per call."""

    def __init__(self, attention_backend: str | None, prefill: str | None, decode: str | None, mode: str) -> None:
        self.attention_backend = attention_backend
        self.prefill_attention_backend = prefill
        self.decode_attention_backend = decode
        self.speculative_attention_mode = mode

    def get_attention_backends(self) -> tuple[str | None, str | None]:
        return (
            self.prefill_attention_backend or self.attention_backend,
            self.decode_attention_backend or self.attention_backend,
        )


_GLOBAL_SERVER_ARGS: _SeedArgs | None = None


def get_global_server_args() -> _SeedArgs:
    assert _GLOBAL_SERVER_ARGS is not None
    return _GLOBAL_SERVER_ARGS


def _make_seed_dispatch(
    get_backend: Callable[[], Any], handlers: dict[str, Callable[..., Any]]
) -> Callable[[Any], Any]:
    def _seed_dispatch(forward_mode: Any) -> Any:
        args = get_global_server_args()
        prefill, decode = args.get_attention_backends()
        backend = get_backend()
        prefill_str = getattr(backend, "prefill_attention_backend_str", None) or prefill
        decode_str = getattr(backend, "decode_attention_backend_str", None) or decode
        if forward_mode.is_decode_or_idle():
            name = decode_str
        elif forward_mode.is_target_verify() or forward_mode.is_draft_extend_v2():
            name = decode_str if args.speculative_attention_mode == "decode" else prefill_str
        else:
            name = prefill_str
        return handlers[name]  # type: ignore[index]  # the seed indexes with str | None too

    return _seed_dispatch


def run(rounds: int, number: int) -> list[Row]:
    global _GLOBAL_SERVER_ARGS

    from attnhost import ModelRunner, ServerArgs, dispatch_attention_backend, get_attn_backend
    from attnhost.forward_mode import ForwardMode

    args = ServerArgs(attention_backend="torch_native", speculative_attention_mode="decode")
    runner = ModelRunner(args, num_layers=1, max_requests=1, max_context_len=16)
    _GLOBAL_SERVER_ARGS = _SeedArgs("torch_native", None, None, "decode")
    handlers: dict[str, Callable[..., Any]] = {"torch_native": lambda: None, "triton": lambda: None}
    seed = _make_seed_dispatch(get_attn_backend, handlers)
    rows = []
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY):
        with runner.forward_context():
            assert seed(mode) is handlers[dispatch_attention_backend(mode)]
            stats = interleaved(
                {
                    "attnhost": per_call(dispatch_attention_backend, number, mode),
                    "seed": per_call(seed, number, mode),
                },
                rounds,
            )
        rows.append(
            Row(
                section="dispatch",
                case=f"mode {mode.name}",
                candidate="dispatch_attention_backend(mode)",
                value=stats["attnhost"].median * 1e9,
                baseline="seed: global args + pair + stamped strs + predicate chain + handler dict",
                baseline_value=stats["seed"].median * 1e9,
                unit="ns/call",
                spread=stats["attnhost"].spread,
                baseline_spread=stats["seed"].spread,
                n=stats["attnhost"].n,
                target="ratio <= 0.2 (5x faster)",
                max_ratio=0.2,
            )
        )
    return rows
