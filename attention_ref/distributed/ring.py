"""Ring attention: the key/value slices travel around the ranks, forward and backward (its autograd).

`ring_attention` checks its arguments, plans the ring (`attention_ref.distributed.schedule`)
and runs `_RingAttention`, whose forward merges the partial results and whose backward sends
each slice's dK/dV accumulator after it and back to its owner.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from attention_ref import _inputs
from attention_ref import mods as _mods
from attention_ref._inputs import batch_shape
from attention_ref._validation import fmt_shape
from attention_ref.block_mask import BlockMask, check_block_mask
from attention_ref.distributed.counting import record
from attention_ref.distributed.layouts import (
    check_layout,
    documents_of,
    group_info,
    layout_offsets,
)
from attention_ref.distributed.schedule import Mask, Plan
from attention_ref.functional import (
    masked_scores,
    merge_attention,
    scaled_dot_product_attention,
)
from attention_ref.sinks import add_sinks, check_sinks, heads_of

# Tags keep the kinds of message apart on backends that match messages by tag (gloo); NCCL ignores
# them and matches by order, which is the same on every rank. _TAG_RET_*: a slice's dK/dV
# accumulator going back to its owner from the last rank that needed the slice.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV, _TAG_RET_DK, _TAG_RET_DV = 0, 1, 2, 3, 4, 5


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` (point-to-point ops take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _post(group: dist.ProcessGroup | None, sends: list[tuple[torch.Tensor, int, int]],
          receives: list[tuple[torch.Tensor, int, int]]) -> tuple[list[Any], list[torch.Tensor]]:
    """Post the sends ``(tensor, group rank, tag)`` (contiguous, kept unchanged until the requests are
    waited for) and the receives ``(like, group rank, tag)``; return (requests, received buffers)."""
    received = [torch.empty_like(like) for like, _, _ in receives]
    ops = [dist.P2POp(dist.isend, t, _global_rank(group, peer), group, tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, r, _global_rank(group, peer), group, tag)
            for r, (_, peer, tag) in zip(received, receives)]
    return (dist.batch_isend_irecv(ops) if ops else []), received


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _reduce_like(grad: torch.Tensor, like: torch.Tensor, group_size: int) -> torch.Tensor:
    """A gradient computed for the expanded heads and broadcast batch, summed back to ``like``'s shape."""
    if group_size > 1:
        # (..., H, n, E) -> (..., Hkv, H / Hkv, n, E) -> (..., Hkv, n, E): query head h used kv head h // group.
        grad = grad.unflatten(-3, (-1, group_size)).sum(dim=-3)
    return grad.sum_to_size(like.shape)


class _RingAttention(torch.autograd.Function):
    """Ring attention of the local slices; see `ring_attention`. Shapes in the legend, ``n = L / world``."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale, enable_gqa, group, layout, rank, world,  # type: ignore[override]
                plan):
        compute = torch.promote_types(query.dtype, torch.float32)
        mine = list(plan.pieces[rank].values())  # this rank's chunks, in local order
        q = query.to(compute)  # (..., H, n, E): the local queries stay here
        out: list[torch.Tensor | None] = [None] * len(mine)  # per local query chunk: (..., H, chunk, Ev)
        lse: list[torch.Tensor | None] = [None] * len(mine)  # (..., H, chunk)
        index = {p.chunk: i for i, p in enumerate(mine)}
        # The key/value slice this rank holds now, in the input dtype (contiguous: sent as it is).
        k_cur, v_cur = key.contiguous(), value.contiguous()
        for step in range(world):
            send, receive = plan.sends_kv(rank, world, step)
            # pass the slice on while computing with it, if a rank further along needs it
            requests, received = _post(group, [(k_cur, (rank + 1) % world, _TAG_K), (v_cur, (rank + 1) % world, _TAG_V)]
                                       if send else [], [(key, (rank - 1) % world, _TAG_K),
                                                         (value, (rank - 1) % world, _TAG_V)] if receive else [])
            if send:
                record(forward_steps=1, forward_bytes=(k_cur.numel() + v_cur.numel()) * k_cur.element_size())
            elif step < world - 1:
                record(forward_steps_skipped=1)
            blocks = [b for b in plan.blocks if b.step == step]
            k_c, v_c = k_cur.to(compute), v_cur.to(compute)  # (..., Hkv, n, E), (..., Hkv, n, Ev)
            if plan.unmasked:  # every pair is full: one call for the whole slice
                o, s = scaled_dot_product_attention(q, k_c, v_c, scale=scale, enable_gqa=enable_gqa, return_lse=True)
                for i, p in enumerate(mine):
                    o_i, s_i = o[..., p.rows, :], s[..., p.rows]
                    out[i], lse[i] = (o_i, s_i) if out[i] is None else merge_attention(out[i], lse[i], o_i, s_i)
                record(blocks_full=len(blocks))
                blocks = []
            for block in blocks:
                record(**{f"blocks_{block.kind}": 1})
                if block.kind == "skipped":
                    continue
                i = index[block.q_chunk]  # the local query chunk
                kv_rows = plan.pieces[block.source][block.kv_chunk].rows  # where the key chunk lies in the slice
                keep = plan.keeps[block.step, block.q_chunk, block.kv_chunk]
                # (..., H, chunk, E) against (..., Hkv, chunk', E): the partial result and its lse.
                o, s = scaled_dot_product_attention(q[..., mine[i].rows, :], k_c[..., kv_rows, :], v_c[..., kv_rows, :],
                                                    keep, scale=scale, enable_gqa=enable_gqa, return_lse=True)
                out[i], lse[i] = (o, s) if out[i] is None else merge_attention(out[i], lse[i], o, s)
            _wait(requests)
            if receive:
                k_cur, v_cur = received
        batch = batch_shape(query, key, value, enable_gqa)  # (..., H) of the output
        for i, p in enumerate(mine):  # a chunk whose queries see no key at all: output 0, lse -inf
            if out[i] is None:
                out[i] = q.new_zeros((*batch, p.length, value.shape[-1]))
                lse[i] = q.new_full((*batch, p.length), float("-inf"))
        # (..., H, n, Ev) and (..., H, n), the compute dtype (an empty part: a rank that holds nothing)
        output = torch.cat([*out, q.new_zeros((*batch, 0, value.shape[-1]))], dim=-2)  # type: ignore[list-item]
        row_lse = torch.cat([*lse, q.new_zeros((*batch, 0))], dim=-1)  # type: ignore[list-item]
        ctx.save_for_backward(query, key, value, output, row_lse)
        ctx.options = (scale, enable_gqa, group, rank, world, plan)
        return output, row_lse  # sink-free, in the compute dtype: ring_attention adds the sink and casts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        query, key, value, output, row_lse = ctx.saved_tensors
        scale, enable_gqa, group, rank, world, plan = ctx.options
        compute = output.dtype
        mine = plan.pieces[rank]
        group_size = _inputs.kv_group(query, key, "key") if enable_gqa else 1
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        q = query.to(compute)
        d_o = d_out.to(compute)  # (..., H, n, Ev)
        # D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the term the softmax backward subtracts: (..., H, n);
        # the lse's own cotangent enters as d lse_i / d S_ij = P_ij, so it is folded into D (with a minus).
        delta = (d_o * output).sum(dim=-1) - d_lse.to(compute)
        # A row with no key has lse = -inf; +inf makes its recomputed weights exp(-inf - inf) = 0, not NaN.
        lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
        dq = torch.zeros(query.shape, dtype=compute, device=query.device)
        k_cur, v_cur = key.contiguous(), value.contiguous()
        carried: list[torch.Tensor] | None = None  # dK/dV of the slice held now, from the ranks it visited before
        own: tuple[torch.Tensor, torch.Tensor] | None = None  # this rank's contribution to its own dK/dV
        returned: list[torch.Tensor] | None = None  # the other ranks' contributions to it, back from the last one
        grad_sends = 0
        for step in range(world):
            held = (rank - step) % world  # whose slice this rank holds (if it reached this rank)
            send, receive = plan.sends_kv(rank, world, step)
            kv_requests, kv_received = _post(group, [(k_cur, nxt, _TAG_K), (v_cur, nxt, _TAG_V)] if send else [],
                                             [(key, prev, _TAG_K), (value, prev, _TAG_V)] if receive else [])
            if send:
                record(backward_kv_steps=1, backward_kv_bytes=(k_cur.numel() + v_cur.numel()) * k_cur.element_size())
            elif step < world - 1:
                record(backward_kv_steps_skipped=1)
            grad_out: list[tuple[torch.Tensor, int, int]] = []
            if step <= plan.hops[held]:
                dk, dv = _RingAttention._block_grads(plan, step, q, k_cur.to(compute), v_cur.to(compute), d_o, delta,
                                                     lse, scale, enable_gqa, group_size, mine, dq, key, value)
                if step == 0:
                    own = (dk, dv)  # kept here: the accumulator of this slice starts at the next rank
                else:
                    if carried is not None:  # add the contributions of the ranks this slice visited before
                        dk, dv = dk + carried[0], dv + carried[1]
                    # pass it on with the slice, or, from the last rank that needs the slice, back to its owner
                    last = step == plan.hops[held]
                    peer, tags = (held, (_TAG_RET_DK, _TAG_RET_DV)) if last else (nxt, (_TAG_DK, _TAG_DV))
                    grad_out = [(dk, peer, tags[0]), (dv, peer, tags[1])]
                    grad_sends += 1
                    record(backward_grad_steps=1, backward_grad_bytes=(dk.numel() + dv.numel()) * dk.element_size())
            # the accumulators: of the slice arriving next (from the previous rank), and after the last
            # step that needs this rank's own slice, its own (from the rank that last held it)
            dk_like, dv_like = own  # type: ignore[misc]  # set at step 0: the shapes and the compute dtype
            arriving = 1 <= step < plan.hops[(rank - 1 - step) % world]
            home = step == plan.hops[rank] >= 1
            grad_in = [(dk_like, prev, _TAG_DK), (dv_like, prev, _TAG_DV)] if arriving else []
            grad_in += [(dk_like, (rank + step) % world, _TAG_RET_DK),
                        (dv_like, (rank + step) % world, _TAG_RET_DV)] if home else []
            grad_requests, grad_received = _post(group, grad_out, grad_in)
            _wait(grad_requests)
            carried = grad_received[:2] if arriving else None
            if home:
                returned = grad_received[-2:]
            _wait(kv_requests)
            if receive:
                k_cur, v_cur = kv_received
        record(backward_grad_steps_skipped=world - 1 - grad_sends)
        dk_total, dv_total = own  # type: ignore[misc]
        if returned is not None:  # what the other ranks added to this rank's slice
            dk_total, dv_total = dk_total + returned[0], dv_total + returned[1]
        return (dq.to(query.dtype), dk_total.to(key.dtype), dv_total.to(value.dtype),
                None, None, None, None, None, None, None, None)

    @staticmethod
    def _block_grads(plan, step, q, k_c, v_c, d_o, delta, lse, scale, enable_gqa, group_size, mine, dq, key, value):
        """This rank's contributions, at ``step``, to dQ (added in place) and to the held slice's dK/dV
        (returned, ``(..., Hkv, n, E)`` and ``(..., Hkv, n, Ev)``, compute dtype)."""
        if enable_gqa:  # (..., Hkv, n, E) -> (..., H, n, E) for the block matmuls
            k_c, v_c = _inputs.expand_kv_heads(q, k_c, "key"), _inputs.expand_kv_heads(q, v_c, "value")
        dk = torch.zeros(key.shape, dtype=q.dtype, device=key.device)  # this rank's part of the slice's dK
        dv = torch.zeros(value.shape, dtype=q.dtype, device=value.device)
        for block in (b for b in plan.blocks if b.step == step and b.kind != "skipped"):
            q_rows = mine[block.q_chunk].rows
            kv_rows = plan.pieces[block.source][block.kv_chunk].rows
            keep = plan.keeps[block.step, block.q_chunk, block.kv_chunk]
            q_b, k_b, v_b, do_b = q[..., q_rows, :], k_c[..., kv_rows, :], v_c[..., kv_rows, :], d_o[..., q_rows, :]
            # FlashAttention-2's backward of one block, with the saved lse of the whole row:
            # P = exp(S - lse), the block's exact softmax weights: (..., H, chunk, chunk')
            p = torch.exp(masked_scores(q_b, k_b, keep, False, scale) - lse[..., q_rows, None])
            # dV_j += P^T dO_i: (..., H, chunk', chunk) @ (..., H, chunk, Ev) -> (..., H, chunk', Ev)
            dv[..., kv_rows, :] += _reduce_like(p.transpose(-2, -1) @ do_b, dv[..., kv_rows, :], group_size)
            # dP = dO_i V_j^T: (..., H, chunk, Ev) @ (..., H, Ev, chunk') -> (..., H, chunk, chunk')
            dp = do_b @ v_b.transpose(-2, -1)
            # dS = P * (dP - D_i): the softmax backward
            ds = p * (dp - delta[..., q_rows, None])
            # dQ_i += scale dS K_j: (..., H, chunk, chunk') @ (..., H, chunk', E) -> (..., H, chunk, E)
            dq[..., q_rows, :] += (scale * ds @ k_b).sum_to_size(dq[..., q_rows, :].shape)
            # dK_j += scale dS^T Q_i: (..., H, chunk', chunk) @ (..., H, chunk, E) -> (..., H, chunk', E)
            dk[..., kv_rows, :] += _reduce_like(scale * ds.transpose(-2, -1) @ q_b, dk[..., kv_rows, :], group_size)
        return dk, dv


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    mask_mod: _mods.MaskMod | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    r"""Attention of this rank's query slice over the whole sequence, its keys and values spread over the ranks.

    Equal (up to rounding) to `attention_ref.functional.scaled_dot_product_attention`
    on the unsharded tensors, sharded back:

        shard(scaled_dot_product_attention(Q, K, V, is_causal=..., scale=..., enable_gqa=..., sinks=...),
              layout=layout) == ring_attention(shard(Q), shard(K), shard(V), ..., sinks=...)

    At each of ``world`` steps this rank computes its queries against the
    key/value slice it holds, with ``scaled_dot_product_attention(...,
    return_lse=True)`` on the chunk pairs that `ring_schedule` lists (a pair in
    which no query sees a key is skipped, one that only some keys take part in is
    computed with its mask, built from the global positions), and merges the partial result
    into its running one with `attention_ref.functional.merge_attention`. While
    it computes, the slice is already on its way to rank ``r + 1`` and the next
    one arriving from rank ``r - 1``. A slice is passed on only while a rank further
    along needs it (`ring_hops`): under a sliding window (``mask_mod``) on the contiguous
    layout, key blocks no query of a rank sees are neither sent to it nor computed
    (`CommStats`' ``*_skipped`` counters). The partial results are sink-free; with
    ``sinks``, each query's sink is added once, to the merged result over all
    keys, by `attention_ref.add_sinks` (a sink in each partial result would be
    counted once per step).

    The backward pass is FlashAttention-2's, block by block, with the saved
    log-sum-exp of the whole row: ``P = exp(S - lse)``, ``dV += P^T dO``,
    ``dS = P * (dO V^T - D)`` with ``D = rowsum(dO * O) - dlse``, ``dQ += scale dS K``,
    ``dK += scale dS^T Q``; ``dO`` and ``dlse`` are the cotangents of the
    sink-free result (``dlse = 0`` without sinks; with them both come from
    `attention_ref.add_sinks`' closed-form backward). The key/value slices
    travel the ring again; each slice's dK/dV accumulator starts at the next
    rank, follows the slice, and goes back to its owner from the last rank that
    needed the slice: one more hop when the slice travelled the whole ring, a
    direct message otherwise (`CommStats` gives the counts).

    Everything is computed in at least float32 (float32 for float16/bfloat16
    inputs); the output and the gradients are returned in the input dtype.
    Every rank must call it with tensors of the same shapes (not checked: a
    mismatch hangs until the process group's timeout). A rank with nothing to send or
    receive at a step makes no point-to-point call; NCCL wants every rank in a group's
    *first* batched point-to-point call, so on NCCL run one collective on ``group``
    (a barrier) before the first masked ring (tested with gloo only, which needs none).

    Args:
        query: ``(..., H, n, E)``, this rank's queries, ``n = L / world``.
        key: ``(..., H, n, E)``, or ``(..., Hkv, n, E)`` with ``enable_gqa``.
        value: ``(..., H, n, Ev)``, or ``(..., Hkv, n, Ev)``.
        is_causal: causal attention over the *global* positions (top-left aligned,
            as ``torch.nn.functional.scaled_dot_product_attention``).
        scale: multiplies the scores; defaults to ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention (``H`` a multiple of ``Hkv``).
        group: the process group of the ring (``None``: the default group).
        layout: how the sequence was split (`shard`): ``"zigzag"`` or ``"contiguous"``.
        sinks: ``(H,)``, one learned logit per query head (`attention_ref.sinks`),
            the same on every rank: a replicated parameter, like the model's
            weights under context parallelism (or one per local query,
            broadcastable to ``(..., H, n)``: this rank's rows, all its own). Its gradient here is **this
            rank's share**, the sum over this rank's queries only, with no
            communication (as `shard` gives a replicated tensor the gradient of
            this rank's slice): the sum of the ranks' ``sinks.grad`` is the
            gradient of the sum of their losses. The all-reduce that sums it is
            the one data/context-parallel training already runs over the
            replicated parameters' gradients (DDP, FSDP); summing here as well
            would count it ``world`` times.
        cu_seqlens: ``(S + 1,)`` cumulative lengths of ``S`` sequences packed along the
            whole length (as `attention_ref.varlen.varlen_attention` takes them, from 0 to
            ``n * world``; Megatron's THD batches): no query attends across a boundary, and
            ``is_causal`` applies within each sequence. Sharded like any packed batch, with
            any layout (``"zigzag-per-sequence"``, Megatron's, needs them); every rank passes
            the same offsets. None: one sequence.
        mask_mod: a mask over *global* positions in FlexAttention's signature
            ``(b, h, q_idx, kv_idx) -> bool`` (True = takes part; `attention_ref.mods`:
            ``sliding_window``, ``chunked``, ``prefix_lm``, ...), the same function on every
            rank, combined with ``is_causal`` and ``cu_seqlens`` (all must hold). ``b`` indexes
            the leading dims before the heads, flattened; ``h`` the query head. Every rank
            plans the whole ring (how far each slice travels): ``causal`` and
            ``sliding_window`` mods are read as bands, at no cost; any other mod is evaluated
            on every chunk pair of every rank, one pair at a time (``N^2`` booleans per call).
        block_mask: a `attention_ref.block_mask.BlockMask` made for the *full* length (``L = S =
            n * world``, as FlexAttention users make one per batch): its ``mask_mod`` masks, as
            ``mask_mod=`` would (pass both only when ``mask_mod`` is ``block_mask.mask_mod``).
            The ring plans its own chunk pairs; the mask's blocks are not used.

    Returns:
        ``(..., H, n, Ev)``, this rank's slice of the output, in ``query``'s dtype.

    Raises:
        RuntimeError: no process group is initialised, or this process is not in ``group``.
        ValueError: shapes that do not fit, query and key slices of different
            lengths, an odd local length with ``"zigzag"`` (the full length must be a
            multiple of ``2 * world``), a bad scale or layout; ``sinks`` not of
            shape ``(H,)``, on another device, NaN or ``+inf``; bad ``cu_seqlens``, or
            none (or a sequence not a multiple of ``2 * world`` long) with
            ``"zigzag-per-sequence"``; a ``mask_mod`` result that does not fit the scores, a
            ``block_mask`` made for another length or batch, or with another ``mask_mod``.
        TypeError: non-float inputs or inputs of different dtypes, ``sinks`` not a float tensor,
            ``mask_mod`` not a mask mod or not returning bool, ``block_mask`` not a `attention_ref.block_mask.BlockMask`.

    Examples:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> from attention_ref import scaled_dot_product_attention
        >>> from attention_ref.distributed import shard, unshard
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
        >>> out = ring_attention(shard(q), shard(k), shard(v), is_causal=True)
        >>> torch.allclose(unshard(out), scaled_dot_product_attention(q, k, v, is_causal=True))
        True
        >>> dist.destroy_process_group()
    """
    layout = check_layout(layout)
    rank, world = group_info(group, "ring_attention")
    query, key, value, _, resolved = _inputs.prepare(query, key, value, None, is_causal, scale, enable_gqa)
    n = query.shape[-2]
    if key.shape[-2] != n:
        raise ValueError(
            f"ring_attention needs query and key slices of one sequence, the same local length (dim -2): "
            f"query {fmt_shape(query.shape)} has {n}, key {fmt_shape(key.shape)} has {key.shape[-2]}"
        )
    if layout == "zigzag" and n % 2:
        raise ValueError(
            f"ring_attention with layout='zigzag' needs the full length to be a multiple of 2 * world = "
            f"{2 * world} (an even local length, two chunks per rank), got local length {n} "
            f"(full length {n * world})"
        )
    if sinks is not None:
        batch = batch_shape(query, key, value, enable_gqa)
        check_sinks(sinks, heads_of(batch), query, rows=(*batch, query.shape[-2]))  # this rank's queries
    _inputs.check_mods(None, mask_mod)
    if block_mask is not None:  # made for the whole sequence: its mod masks the global positions
        check_block_mask(block_mask, mask_mod, batch_shape(query, key, value, enable_gqa), n * world, n * world)
        mask_mod = block_mask.mask_mod
    cu = layout_offsets("ring_attention", layout, cu_seqlens, n * world, world, query.device)
    documents = None if cu_seqlens is None else documents_of(cu_seqlens, n * world, query.device)  # (n * world,)
    mask = Mask(is_causal, documents, mask_mod, batch_shape(query, key, value, enable_gqa), n * world)
    plan = Plan.make(rank, world, n, layout, mask, cu, query.device)
    # (..., H, n, Ev) and (..., H, n): the sink-free result over every key of the ring, compute dtype
    output, lse = _RingAttention.apply(query, key, value, is_causal, resolved, enable_gqa, group, layout, rank, world,
                                       plan)
    if sinks is not None:
        output, _ = add_sinks(output, lse, sinks)  # once per query, after the last merge
    return output.to(query.dtype)
