"""TEST-ONLY: SGLang's MHA KV pool with torch KV moves instead of the tiled triton copy.

With speculative decoding SGLang builds its ``MHATokenToKVPool`` with
``enable_kv_cache_copy=True``, which configures and warms up a triton byte
copy over raw data pointers (``copy_all_layer_kv_cache_func``), used later to
move accepted tree tokens' KV. A pointer-based triton kernel does not run on
a CPU, not even interpreted, so this subclass (returned by the test platform's
``get_kv_pool_cls``, the seam SGLang provides for exactly this) skips the
warm-up and always takes SGLang's own torch move (``move_kv_cache_native``,
the path ``SGLANG_NATIVE_MOVE_KV_CACHE`` selects). Storage and addressing stay
SGLang's.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, move_kv_cache_native


class TorchMoveMHATokenToKVPool(MHATokenToKVPool):
    """SGLang's MHA pool; KV moves by torch indexing."""

    def _init_kv_copy_and_warmup(self) -> None:
        self._kv_copy_config = None

    def _move_kv_cache_impl(self, tgt_loc: Any, src_loc: Any) -> None:
        move_kv_cache_native(self.k_buffer, self.v_buffer, tgt_loc, src_loc)
