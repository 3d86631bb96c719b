"""Decode attention and the token window: the torch references against plain math (CPU, always), the split-KV
planner's choices, and the CUDA kernels against their references, odd sizes and graph replays included (marked gpu)."""

from __future__ import annotations

import pytest
import torch
from kernel_util import GPU, bf16_input, capture

from rtts import kernels
from rtts.kernels import attention, gemm
from rtts.kernels import reference as ref
from rtts.kernels.common import sm_count

# ---------------------------------------------------------------------------------------------------- references


def test_reference_decode_attention_matches_sdpa() -> None:
    B, H, n_kv, D, L = 3, 8, 2, 64, 40
    q = bf16_input(B, H, D, seed=3)
    kc, vc = bf16_input(5, L, n_kv, D, seed=4), bf16_input(5, L, n_kv, D, seed=5)
    slots, lens = torch.tensor([4, 0, 2]), torch.tensor([40, 1, 17])
    out = ref.decode_attention(q, kc, vc, slots, lens).float()
    for b in range(B):
        n = int(lens[b])
        k = kc[slots[b], :n].float().permute(1, 0, 2).repeat_interleave(H // n_kv, 0)  # [H, n, D]
        v = vc[slots[b], :n].float().permute(1, 0, 2).repeat_interleave(H // n_kv, 0)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0]
        assert torch.allclose(out[b], sdpa, atol=2e-2)


def test_reference_token_window() -> None:
    buf = torch.arange(4 * 3 * 2, dtype=torch.int32).view(4, 3, 2)
    before = buf.clone()
    kernels.token_window_shift(buf, torch.tensor([2, 0]), torch.tensor([[100, 101], [200, 201]], dtype=torch.int32),
                               torch.tensor([True, False]))
    assert torch.equal(buf[2], torch.tensor([[before[2, 1, 0], before[2, 1, 1]], [before[2, 2, 0], before[2, 2, 1]],
                                             [100, 101]], dtype=torch.int32))
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[1], before[1])


# ---------------------------------------------------------------------------------------------------- CUDA parity


@GPU
@pytest.mark.parametrize("B,L", [(1, 1), (1, 700), (16, 2048), (64, 2048), (3, 130)])
@pytest.mark.parametrize("n_kv,G,D", [(8, 4, 128), (8, 2, 64), (2, 1, 128), (2, 8, 128), (4, 8, 64)])
def test_decode_attention_kernel(B: int, L: int, n_kv: int, G: int, D: int) -> None:
    rows = B + 2
    q = bf16_input(B, n_kv * G, D, seed=B, device="cuda")
    kc, vc = bf16_input(rows, L, n_kv, D, seed=1, device="cuda"), bf16_input(rows, L, n_kv, D, seed=2, device="cuda")
    g = torch.Generator().manual_seed(L)
    slots = torch.randperm(rows, generator=g)[:B].cuda()
    lens = torch.randint(1, L + 1, (B,), generator=g).cuda()
    lens[0] = L
    r = ref.decode_attention(q, kc, vc, slots, lens).float()
    for s, n in zip(slots.tolist(), lens.tolist(), strict=True):  # positions past a length must never be read
        kc[s, n:] = float("nan")
        vc[s, n:] = float("nan")
    out = kernels.decode_attention(q, kc, vc, slots, lens).float()
    assert (out - r).abs().max() < 2e-2


@GPU
@pytest.mark.parametrize("B,fused", [(1, True), (16, False)])
def test_decode_attention_split_merge_is_deterministic_and_replays(B: int, fused: bool) -> None:
    """Split-KV over 2048 keys, merged by the last split of each KV head (one stream: many splits, one wave) or by
    the second launch (16 streams): the counters must be back at zero after every launch (graph replays reuse
    them) and the bits must not depend on which CTA merged. A graph captured once serves new lengths, down to one
    key (every later split empty)."""
    L, n_kv, G, D = 2048, 8, 4, 128
    S, _ = attention.attention_splits(B, n_kv, L, sm_count(0))
    assert S > 1 and attention.attention_fuses(B, n_kv, S, sm_count(0)) == fused
    q = bf16_input(B, n_kv * G, D, seed=5, device="cuda")
    kc, vc = bf16_input(B + 1, L, n_kv, D, seed=6, device="cuda"), bf16_input(B + 1, L, n_kv, D, seed=7, device="cuda")
    slots = torch.arange(1, B + 1, device="cuda")
    lens = torch.full((B,), L, device="cuda")
    first = kernels.decode_attention(q, kc, vc, slots, lens)
    for _ in range(5):
        assert torch.equal(kernels.decode_attention(q, kc, vc, slots, lens), first)
    assert not gemm.streamk_scratch(torch.device("cuda")).att_counters.any()
    kernels.warmup(torch.device("cuda"))
    g, out = capture(lambda: kernels.decode_attention(q, kc, vc, slots, lens))
    for n in (L, 1, 63, 64, 65, 1000, L):
        lens.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        r = ref.decode_attention(q, kc, vc, slots, lens).float()
        assert (out.float() - r).abs().max() < 2e-2, n
    assert torch.equal(out, first)
    assert not gemm.streamk_scratch(torch.device("cuda"), for_graphs=True).att_counters.any()


def test_attention_fuses_the_merge_only_for_one_wave_of_enough_splits() -> None:
    sms = 132
    assert attention.attention_fuses(1, 8, 32, sms) and attention.attention_fuses(1, 8, 8, sms)
    assert not attention.attention_fuses(16, 8, 3, sms)  # too few splits: the second launch was faster
    assert not attention.attention_fuses(12, 8, 8, sms)  # 768 CTAs: two waves
    assert not attention.attention_fuses(1, 8, 1, sms)


def test_attention_splits_are_bounded() -> None:
    """The merging CTA holds 2 x splits x G floats in its pipeline memory: the planner never exceeds the cap."""
    for B, n_kv, L in [(1, 1, 1 << 16), (1, 8, 1 << 15), (64, 8, 2048), (1, 8, 1)]:
        S, chunk = attention.attention_splits(B, n_kv, L)
        assert 1 <= S <= attention.MAX_SPLITS and S * chunk >= L and (S - 1) * chunk < L
    assert 2 * attention.MAX_SPLITS * 8 * 4 <= attention.attention_smem_bytes(64)


def test_attention_splits_on_the_h200_shapes() -> None:
    """S2-Pro's 8 KV heads on 132 SMs: the split counts that measured fastest (bench/probes/attention_variants.py,
    session 15): one wave, 64-key tiles at 512 keys and two per split at 2048 for one stream (merging 32 splits cost
    more than streaming a second tile), two splits from 16 streams, none from 64."""
    picks = {(B, L): attention.attention_splits(B, 8, L, 132)[0] for B in (1, 16, 64) for L in (512, 2048)}
    assert picks == {(1, 512): 8, (1, 2048): 16, (16, 512): 2, (16, 2048): 2, (64, 512): 1, (64, 2048): 1}


@GPU
def test_token_window_kernel() -> None:
    buf = torch.randint(0, 1000, (9, 10, 1), dtype=torch.int32, device="cuda")
    rbuf = buf.clone()
    slots = torch.tensor([3, 8, 8, 0], device="cuda")  # 8 = padded rows on a scratch slot
    new = torch.randint(0, 1000, (4, 1), dtype=torch.int32, device="cuda")
    active = torch.tensor([True, False, False, True], device="cuda")
    kernels.token_window_shift(buf, slots, new, active)
    ref.token_window_shift(rbuf, slots, new, active)
    assert torch.equal(buf, rbuf)
