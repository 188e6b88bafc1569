"""TEST-ONLY pure-torch stand-ins for the speculative kernels SGLang 0.5.23 refuses on an out-of-tree platform.

``sglang.kernels.ops.speculative.spec_tree.build_tree_kernel_efficient_func``
and ``verify_tree_greedy_func`` dispatch on the device and call
``reject_out_of_tree_path`` for any platform they do not know, so no
out-of-tree platform can run a speculative round at all (chain or tree: the
chain goes through them too). The two functions below are line-by-line ports
of SGLang's own triton kernels in that module
(``sgl_build_tree_kernel_efficient_triton``, ``verify_tree_greedy_kernel_triton``:
one loop iteration here per program there, the same reads and writes in the
same order), so that what the engine runs on the CPU is SGLang's algorithm,
not a re-invention; tests/sglang/test_spec_kernels.py compares them with the
triton kernels run under ``TRITON_INTERPRET=1``.

:func:`assign_extend_cache_locs` is what the test platform answers for
``get_speculative_cache_locs_fn``: the verify window's KV slots, read from
``req_to_token`` as SGLang's ``assign_extend_cache_locs`` kernel does.

Installed by :mod:`attnhost_sglang_cpu.plugin` through SGLang's ``HookRegistry``
only when the test platform is selected. They are small-batch test code: Python
loops over requests and draft tokens.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assign_extend_cache_locs", "build_tree_kernel_efficient", "verify_tree_greedy"]

_FULL_MASK, _QLEN_ONLY, _QLEN_ONLY_BITPACKING = 0, 1, 2


def _find(values: list[int], wanted: int, limit: int) -> int:
    """The first index ``< limit`` whose value is *wanted*, or -1 (the kernels' guarded search loops)."""
    for index in range(limit):
        if values[index] == wanted:
            return index
    return -1


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int,
) -> None:
    """``build_tree_kernel_efficient_func``: the verify tree's mask, positions and retrieval links, in place."""
    mode = int(tree_mask_mode)
    if mode == _QLEN_ONLY_BITPACKING:
        raise NotImplementedError("QLEN_ONLY_BITPACKING is not supported by SGLang's triton tree kernel either")
    dtn, depth = num_verify_tokens, spec_steps
    lens = seq_lens.tolist()
    parents = parent_list.reshape(len(lens), -1).tolist() if parent_list.numel() else [[] for _ in lens]
    selected = top_scores_index.tolist()
    next_token = retrieve_next_token.tolist()
    next_sibling = retrieve_next_sibling.tolist()
    index_rows = retrieve_index.tolist()
    pos = positions.tolist()
    mask = tree_mask.view(-1)
    prefix_sum = 0
    for b, seq_len in enumerate(lens):
        sel, par = selected[b], parents[b]
        seq_tree_idx = dtn * dtn * b + prefix_sum * dtn
        pos[b * dtn] = seq_len
        for i in range(dtn - 1, 0, -1):
            index_rows[b][i] = b * dtn + i
            parent_tb_idx = sel[i - 1] // topk
            parent_position = 0
            found = parent_tb_idx == 0
            if not found:
                at = _find(sel, par[parent_tb_idx], dtn - 1)
                if at >= 0:
                    parent_position, found = at + 1, True
            if found:
                previous = next_token[b][parent_position]
                next_token[b][parent_position] = i
                if previous != -1:
                    next_sibling[b][i] = previous
        index_rows[b][0] = b * dtn
        for x in range(dtn):
            if mode == _FULL_MASK:
                token_tree_idx = seq_tree_idx + (seq_len + dtn) * x + seq_len + 1
            else:
                token_tree_idx = dtn * dtn * b + dtn * x + 1
            row = [True] + [False] * (dtn - 1)  # mask[token_tree_idx - 1 ...]: itself, then the other drafts
            if x > 0:
                cur_position, position = x - 1, 0
                for _ in range(depth):
                    position += 1
                    row[1 + cur_position] = True
                    parent_tb_idx = sel[cur_position] // topk
                    if parent_tb_idx == 0:
                        break
                    cur_position = _find(sel, par[parent_tb_idx], dtn - 1)
                    if cur_position < 0:
                        break
                pos[b * dtn + x] = position + seq_len
            mask[token_tree_idx - 1 : token_tree_idx - 1 + dtn] = torch.tensor(row, dtype=mask.dtype)
        prefix_sum += seq_len
    retrieve_index.copy_(torch.tensor(index_rows, dtype=retrieve_index.dtype))
    retrieve_next_token.copy_(torch.tensor(next_token, dtype=retrieve_next_token.dtype))
    retrieve_next_sibling.copy_(torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype))
    positions.copy_(torch.tensor(pos, dtype=positions.dtype))


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    topk: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``verify_tree_greedy_func``: walk the tree along the target's greedy tokens; fills the first three in place."""
    batch_size, dtn = candidates.shape
    num_spec = accept_index.shape[1]
    cand = candidates.tolist()
    r_index = retrieve_index.tolist()
    r_next = retrieve_next_token.tolist()
    r_sibling = retrieve_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    accepted = accept_index.tolist()
    counts = accept_token_num.tolist()
    writes: list[tuple[int, int]] = []
    for bx in range(batch_size):
        last = r_index[bx][0]
        accepted[bx][0] = last
        num_accept = cur_index = 0
        for _ in range(1, num_spec):
            cur_index = r_next[bx][cur_index]
            target_token = target[last]
            found_match = 0
            for _ in range(dtn):
                if cur_index == -1:
                    found_match = -1
                    break
                draft_index = r_index[bx][cur_index]
                if cand[bx][cur_index] == target_token:
                    writes.append((last, target_token))
                    accepted[bx][num_accept + 1] = draft_index
                    num_accept += 1
                    last = draft_index
                    found_match = 1
                    break
                cur_index = r_sibling[bx][cur_index]
            if found_match != 1:
                break
        counts[bx] = num_accept
        writes.append((last, target[last]))
    for where, token in writes:
        pred[where] = token
    accept_index.copy_(torch.tensor(accepted, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(counts, dtype=accept_token_num.dtype))
    return predicts, accept_index, accept_token_num


def assign_extend_cache_locs(
    *,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device: Any,
) -> torch.Tensor:
    """Each request's ``req_to_token[req, start:end]``, concatenated (SGLang's ``assign_extend_cache_locs``)."""
    out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist()[:batch_size],
        start_offset.tolist()[:batch_size],
        end_offset.tolist()[:batch_size],
        strict=True,
    ):
        out[offset : offset + end - start] = req_to_token[req, start:end]
        offset += end - start
    return out
