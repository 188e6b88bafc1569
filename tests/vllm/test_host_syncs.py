"""No host sync in a step: vLLM's batches through the adapter with every device tensor refusing host reads.

vLLM's own ``CommonAttentionMetadata`` (the layer kit's ``make_case``) with its device tensors (query starts,
lengths, block table, slot mapping) and each layer's inputs wrapped in
:class:`~attnhost.testing.host_reads.DeviceOnly`: the metadata builder and every layer's impl run a whole step
for ``batched_matmul`` (which declares graph support) without reading any of them on the host. The kit's check
then holds as in every other case: outputs against float64 attention, every new token's K/V where
``slot_mapping`` says, ``-1`` rows (a drafter's rejected tokens, padding) written nowhere.
"""

from __future__ import annotations

import pytest
import torch
from attnhost_vllm_cpu.forward import BATCHES, ForwardCase, check
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from attnhost.testing.host_reads import HostReadError


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_every_batch_kind_reads_nothing_on_the_host(batch: str, block_size: int) -> None:
    fcase = ForwardCase(batch, "gqa", block_size, torch.float32)
    check(AttentionBackendEnum.BATCHED_MATMUL.get_class(), fcase, f"batched_matmul, {fcase.describe()}", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("slots", [[5, -1, 9, -1, 2], [-1, -1, 3], [-1, -1]], ids=["mixed", "leading", "none"])
def test_the_write_that_skips_padding_reads_nothing_and_writes_only_real_slots(
    dtype: torch.dtype, slots: list[int]
) -> None:
    """``VLLMKVCache.set_kv_skipping_padding``: the real rows' bytes are the contract's write (``quantize_fp8`` for an
    FP8 cache), every other slot keeps its bytes, a batch of only ``-1`` rows included; no read on the host."""
    from attnhost.dtypes import quantize_fp8
    from attnhost.engines.vllm.adapter import VLLMKVCache
    from attnhost.testing.host_reads import device_only, no_host_reads

    torch.manual_seed(0)
    store = (
        torch.randn(12, 2, 2 * 8).to(dtype)
        if dtype.itemsize > 1
        else torch.randint(0, 120, (12, 2, 16), dtype=torch.uint8).view(dtype)
    )
    before = store.clone()
    views = {0: (store[..., :8], store[..., 8:], store)}
    cache = VLLMKVCache(torch.device("cpu"), dtype, torch.zeros(1, 1, dtype=torch.int64), views)
    loc = torch.tensor(slots)
    k, v = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    with no_host_reads():
        cache.set_kv_skipping_padding(0, device_only(loc), device_only(k), device_only(v), k_scale=0.5, v_scale=2.0)
    raw, old = (
        store.view(torch.uint8) if dtype.itemsize == 1 else store,
        before.view(torch.uint8) if dtype.itemsize == 1 else before,
    )
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        for half, new, scale in ((slice(0, 8), k, 0.5), (slice(8, 16), v, 2.0)):
            want = quantize_fp8(new[row], scale, dtype).view(torch.uint8) if dtype.itemsize == 1 else new[row].to(dtype)
            assert torch.equal(raw[slot, :, half], want), f"slot {slot} (row {row}) does not hold its new K/V"
    untouched = [s for s in range(12) if s not in slots]
    assert torch.equal(raw[untouched], old[untouched]), "a slot no real row names was written"


def test_a_backend_that_reads_on_the_host_is_caught() -> None:
    """The detector is live: torch_native plans from exact host lengths (it declares no graph support), which vLLM
    keeps only as bounds, so its batch is read on its behalf, and the same step raises naming the read."""
    fcase = ForwardCase("mixed", "gqa", 16, torch.float32)
    with pytest.raises(AssertionError, match="metadata builder raised HostReadError") as caught:
        check(AttentionBackendEnum.TORCH_NATIVE.get_class(), fcase, "torch_native", False)
    assert isinstance(caught.value.__cause__, HostReadError)
