"""How a DFlash training step's attention is fastest on this CPU: three ways to compute the same thing.

N blocks of Q slots per row attend to the T context keys strictly before their anchor and to their own Q
keys, non-causally (``drafts/dflash.py``). Timed, forward + backward, at the quickstart's shapes (T = 512,
SmolLM2-135M's 9 query / 3 key-value heads of 64):

  split   draftsmith's: the context scores [N·Q, T] and each block's own [Q, Q] apart, one softmax over
          both (``DFlashAttention``): no score is computed for another block's keys
  dense   one ``scaled_dot_product_attention`` over the keys [T + N·Q] with a boolean mask
  flex    ``flex_attention`` with a block mask from the same rule (compiled, as it must be off GPU)

Every way's output is checked against ``split``'s. Prints a table, writes JSON.

    python bench/dflash_attention.py --anchors 16 64 128 --out bench/results/dflash_attention.json
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from benchlib.records import bench_record, write_json

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def inputs(T: int, N: int, Q: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, N * Q, HEAD_DIM, generator=g)
    k_ctx, v_ctx = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g) for _ in range(2))
    k_own, v_own = (torch.randn(1, KV_HEADS, N * Q, HEAD_DIM, generator=g) for _ in range(2))
    anchors = torch.randperm(T - 1, generator=g)[:N].sort().values + 1
    return [t.requires_grad_() for t in (q, k_ctx, v_ctx, k_own, v_own)], anchors


def split(q, k_ctx, v_ctx, k_own, v_own, anchors, Q):
    N = anchors.numel()
    g = HEADS // KV_HEADS
    k_ctx, v_ctx, k_own, v_own = (t.repeat_interleave(g, 1) for t in (k_ctx, v_ctx, k_own, v_own))
    T = k_ctx.shape[2]
    qb = q.view(1, HEADS, N, Q, HEAD_DIM)
    s_ctx = torch.einsum("bhnqd,bhcd->bhnqc", qb, k_ctx) * HEAD_DIM**-0.5
    allowed = torch.arange(T)[None, :] < anchors[:, None]  # [N, T]
    s_ctx = s_ctx.masked_fill(~allowed[None, None, :, None, :], float("-inf"))
    ko, vo = (t.view(1, HEADS, N, Q, HEAD_DIM) for t in (k_own, v_own))
    s_own = torch.einsum("bhnqd,bhnkd->bhnqk", qb, ko) * HEAD_DIM**-0.5
    p = torch.cat([s_ctx, s_own], -1).softmax(-1)
    out = torch.einsum("bhnqc,bhcd->bhnqd", p[..., :T], v_ctx) + torch.einsum(
        "bhnqk,bhnkd->bhnqd", p[..., T:], vo
    )
    return out.reshape(1, HEADS, N * Q, HEAD_DIM)


def dense_mask(T: int, anchors: torch.Tensor, Q: int) -> torch.Tensor:
    N = anchors.numel()
    block = torch.arange(N).repeat_interleave(Q)  # the block of each query / own key
    ctx = torch.arange(T)[None, :] < anchors[block][:, None]  # [NQ, T]
    own = block[:, None] == block[None, :]  # [NQ, NQ]
    return torch.cat([ctx, own], -1)


def dense(q, k_ctx, v_ctx, k_own, v_own, anchors, Q):
    k, v = torch.cat([k_ctx, k_own], 2), torch.cat([v_ctx, v_own], 2)
    mask = dense_mask(k_ctx.shape[2], anchors, Q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def make_flex(T: int, anchors: torch.Tensor, Q: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    N = anchors.numel()

    def rule(b, h, q_idx, kv_idx):
        block = q_idx // Q
        return torch.where(kv_idx < T, kv_idx < anchors[block], (kv_idx - T) // Q == block)

    mask = create_block_mask(rule, 1, 1, N * Q, T + N * Q, device="cpu")
    compiled = torch.compile(flex_attention)

    def flex(q, k_ctx, v_ctx, k_own, v_own, anchors, Q):
        k, v = torch.cat([k_ctx, k_own], 2), torch.cat([v_ctx, v_own], 2)
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return flex


def timed(fn, tensors, anchors, Q, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn(*tensors, anchors, Q)
    out.sum().backward()  # warm-up (and compilation)
    best = float("inf")
    for _ in range(repeats):
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        out = fn(*tensors, anchors, Q)
        out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best, out.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--anchors", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-flex", action="store_true", help="leave out flex attention (its compile is slow)")
    p.add_argument("--out", default="bench/results/dflash_attention.json")
    args = p.parse_args()
    rows = []
    print(
        f"{'anchors':>7} {'queries':>7} {'split ms':>9} {'dense ms':>9} {'flex ms':>9}  max |dense - split|, |flex - split|"
    )
    for N in args.anchors:
        tensors, anchors = inputs(args.context, N, args.block)
        ways = {"split": split, "dense": dense}
        if not args.no_flex:
            ways["flex"] = make_flex(args.context, anchors, args.block)
        result, row = {}, {"anchors": N, "queries": N * args.block}
        for name, fn in ways.items():
            try:
                result[name] = timed(fn, tensors, anchors, args.block, args.repeats)
            except NotImplementedError as e:  # torch 2.13's flex attention has no backward on CPU
                row[f"{name}_error"] = str(e).splitlines()[0]
        ref = result["split"][1]
        for name, (seconds, out) in result.items():
            row[f"{name}_ms"] = seconds * 1000
            row[f"{name}_max_diff"] = float((out - ref).abs().max())
        rows.append(row)
        diffs = ", ".join(f"{row[f'{n}_max_diff']:.1e}" if n in result else row[f"{n}_error"] for n in ways
                          if n != "split")  # fmt: skip
        print(f"{N:>7} {N * args.block:>7} {row['split_ms']:>9.1f} {row['dense_ms']:>9.1f} "
              f"{row.get('flex_ms', float('nan')):>9.1f}  {diffs}")  # fmt: skip
    shapes = SimpleNamespace(
        name="SmolLM2-135M's attention shapes", device=torch.device("cpu"), dtype=torch.float32
    )
    write_json(args.out, bench_record(shapes, vars(args), rows=rows))


if __name__ == "__main__":
    main()
