"""Exact incremental decoding of the ModifiedDAC codec (docs/architecture.md, the model: streaming decode).

The decode path (VQ sum -> windowed causal post transformer -> causal upsampler -> causal decoder) never
looks ahead, so decoding a stream chunk by chunk with the right carried context gives the same samples as
decoding the whole code sequence at once. Carried per slot:
- every causal conv with left context: its last `(k-1)*d` input samples (the zero padding at t = 0);
- every causal transposed conv: its previous input step (the one whose output overlaps the next block);
- the post transformer: K (after RoPE) and V of the last `window - 1` frames per layer, and the absolute
  position of the next frame, so RoPE positions run 0..T-1 exactly as in a whole decode.

All of it lives in preallocated tensors with a leading `capacity` dimension; a call gathers the rows of
its slots, runs the chunk, and scatters the new context back (no per-slot Python objects, no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rtts.model.codec_conv import step_sequence

if TYPE_CHECKING:
    from rtts.model.codec import Codec


@dataclass
class CodecStreamState:
    """Streaming decode state of `capacity` independent slots.

    tails: one tensor per stateful conv of the decode path, [capacity, C_in, context] (tail_id order).
    kv: post-transformer cache [capacity, n_layer, 2 (K, V), n_head, window - 1, head_dim]; K is stored
        after RoPE. Entries before position 0 are masked out, so zeros are a valid empty cache.
    pos: [capacity] int64, frames decoded so far by each slot (= RoPE position of its next frame).
    """

    tails: list[torch.Tensor]
    kv: torch.Tensor
    pos: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.pos.shape[0]

    def reset(self, mask: torch.Tensor) -> None:
        """Zero the state of the slots where `mask` ([capacity] bool) is True, in place."""
        for tensor in (*self.tails, self.kv, self.pos):
            tensor.masked_fill_(mask.view(-1, *([1] * (tensor.ndim - 1))), 0)


def new_stream_state(codec: Codec, capacity: int) -> CodecStreamState:
    """Zero state for `capacity` slots on the codec's device, in the codec's dtype."""
    device, dtype = codec.device, codec.dtype
    post = codec.config.post_module
    tails = [torch.zeros(capacity, c, n, device=device, dtype=dtype) for c, n in codec.stream_tail_shapes]
    kv_shape = (capacity, post.n_layer, 2, post.n_head, post.window_size - 1, post.head_dim)
    return CodecStreamState(
        tails=tails,
        kv=torch.zeros(kv_shape, device=device, dtype=dtype),
        pos=torch.zeros(capacity, device=device, dtype=torch.long),
    )


def decode_stream(
    codec: Codec, codes: torch.Tensor, state: CodecStreamState, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode the next `t` frames of each listed slot.

    codes: [B, 10, t] (t >= 1); slots: [B] int64, distinct (None = arange(B))
    -> audio [B, t * frame_length]
    """
    if codes.ndim != 3 or codes.shape[-1] < 1:
        raise ValueError(f"codes must be [B, {codec.config.num_codebooks}, t>=1], got {tuple(codes.shape)}")
    if slots is None:
        slots = torch.arange(codes.shape[0], device=state.pos.device)
    slots = slots.to(state.pos.device)  # no-op (no copy, no sync) when the caller keeps it there
    if slots.shape != (codes.shape[0],):
        raise ValueError(f"slots must be [{codes.shape[0]}], got {tuple(slots.shape)}")
    # NOTE: duplicate slots in one call would race on the scatter below; checking needs a host sync, so
    # distinctness is the caller's contract.
    tails = [t.index_select(0, slots) for t in state.tails]
    kv, start = state.kv.index_select(0, slots), state.pos.index_select(0, slots)

    z = codec.codes_to_latent(codes)
    z, kv = codec.quantizer.post_module.step(z, kv, start)
    z = step_sequence(codec.quantizer.upsample, z, tails)
    audio = codec.decoder.step(z, tails)

    for tensor, new in zip(state.tails, tails):
        tensor.index_copy_(0, slots, new)
    state.kv.index_copy_(0, slots, kv)
    state.pos.index_copy_(0, slots, start + codes.shape[-1])
    return audio[:, 0]
