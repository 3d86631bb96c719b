"""The engine: a loaded DualAR model, its slot-indexed KV caches and per-slot sampling state, and the two operations
the scheduler needs — prefill a slot, and one batched decode step over any set of slots.

Per-slot state lives in preallocated device tensors indexed by slot (`SlotState`); a reused slot is reset by mask.
One extra slot (`scratch_slot`, the last row) absorbs the padded rows of a fixed-size batch, so CUDA-graph replays
never touch a live stream. `decode_step` reads only device tensors and does no host synchronisation: the next inputs
are the columns the previous step wrote into `state.last_col`.

Frame bookkeeping follows the reference: frame 0 of a turn is sampled from the prefill's last position (no RAS, no
repetition penalty, its token is never checked for `<|im_end|>`); each decode step feeds the previous frame's column
and samples the next frame. A turn's kept codes are every sampled frame but the last (the `<|im_end|>` frame, or the
frame that hit the cap), and exactly those are in the KV cache when the turn ends.

After `capture_graphs()` the scheduler's batched operations (`decode_batch`, `prefill_batch`) replay CUDA graphs
(rtts/engine/graphs/) instead of launching op by op; the engine owns those runners and alone replays them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rtts import kernels
from rtts.engine import sampling
from rtts.engine.graphs.decode import DecodeRunner
from rtts.engine.graphs.prefill import FrameZeroRunner, PrefillRunner
from rtts.kernels import draw
from rtts.kernels.rng import exponential_noise
from rtts.model.dual_ar import DualARTransformer
from rtts.model.kv_cache import KVCache
from rtts.model.loading import LoadedModel
from rtts.model.rope import rope_table
from rtts.types import FinishReason, SamplingParams

# seeds [B], counters [B], draw id, vocabulary ids [n] -> Exp(1) noise [B, n]
NoiseFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
TraceFn = Callable[[str, torch.Tensor], None]

RAS_WINDOW = 10  # S2: last 10 main tokens
PENALTY_WINDOW = 16  # S1: last 16 frames
S1_FAST_VOCAB = 1024  # S1 cuts the fast logits to the first 1024 before the penalty
RAS_TEMPERATURE, RAS_TOP_P = 1.0, 0.9
DRAW_MAIN, DRAW_RAS = 0, 1  # draw ids 2.. are the fast codebooks


@dataclass
class SlotState:
    """Device tensors, leading dim = max_slots + 1 (the last row is the scratch slot). Written only by the engine."""

    pos: torch.Tensor  # [S] int64: KV length = position the next fed column goes to
    last_col: torch.Tensor  # [S, rows] int64: the newest sampled column (fed by the next decode step)
    frame: torch.Tensor  # [S] int64: frames sampled in the current turn
    max_frames: torch.Tensor  # [S] int64
    counter: torch.Tensor  # [S] int64: RNG step counter, never reset within a stream
    seed: torch.Tensor  # [S] int64
    temperature: torch.Tensor  # [S] float32 (already rounded to the reference's parameter dtype)
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64 (a huge value = no top-k)
    penalty: torch.Tensor  # [S] float32 (S1)
    ras_on: torch.Tensor  # [S] bool (S2)
    window: torch.Tensor  # [S, 10, 1] int32 (S2 RAS): last main tokens of decode steps, zeros first
    ring: torch.Tensor  # [S, 16, rows] int64 (S1 penalty): columns of decode frames at (frame - 1) % 16
    ring_n: torch.Tensor  # [S] int64 (S1): decode frames written into the ring
    finish: torch.Tensor  # [S] int8 FinishReason of the newest frame

    @classmethod
    def allocate(cls, slots: int, rows: int, device: torch.device) -> SlotState:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            pos=z(slots), last_col=z(slots, rows), frame=z(slots), max_frames=z(slots), counter=z(slots),
            seed=z(slots), temperature=z(slots, dtype=torch.float32), top_p=z(slots, dtype=torch.float32),
            top_k=z(slots), penalty=z(slots, dtype=torch.float32), ras_on=z(slots, dtype=torch.bool),
            window=z(slots, RAS_WINDOW, 1, dtype=torch.int32), ring=z(slots, PENALTY_WINDOW, rows), ring_n=z(slots),
            finish=z(slots, dtype=torch.int8),
        )

    def reset(self, mask: torch.Tensor) -> None:
        """Zero every field of the slots in `mask` ([S] bool), in place."""
        for f in fields(self):
            t: torch.Tensor = getattr(self, f.name)
            t[mask] = 0


@dataclass
class PrefillItem:
    """A piece of prompt for one slot. sample=True on the last piece of a text turn: it samples frame 0."""

    slot: int
    columns: torch.Tensor  # [rows, T] int64 (CPU)
    sample: bool = False


class ContextFullError(RuntimeError):
    """A prefill would not fit in the slot's KV context."""


# Prompts per prefill batch: a burst of turns starts in batches of it. 16 rather than 8: a burst wider than 8 turns
# reaches first audio sooner, for one more prefill graph bucket to capture (figures: bench/results/graphs/README.md).
DEFAULT_PREFILL_ROWS = 16


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_slots: int = 1,
        max_ctx: int | None = None,
        prefill_chunk: int = 512,
        residual_limit: int | None = None,
        prefill_rows: int = DEFAULT_PREFILL_ROWS,
    ) -> None:
        """
        max_ctx: KV positions per slot (default: the model's max_seq_len, capped at 4096).
        residual_limit: if set, restrict codebooks 1.. to ids < residual_limit (the codec's residual codebook size).
            Off by default: the S2 reference samples all ids and lets the codec clamp.
        """
        self.loaded = loaded
        self.model: DualARTransformer = loaded.model
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        w = self.model.embeddings.weight
        self.device, self.dtype = w.device, w.dtype
        self.format = cfg.format
        self.max_slots = max_slots
        self.scratch_slot = max_slots
        self.max_ctx = max_ctx or min(cfg.max_seq_len, 4096)
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.rows = cfg.rows
        self.sem_begin = self.tokenizer.semantic_begin_id
        self.sem_end = self.tokenizer.semantic_end_id
        self.im_end = self.tokenizer.im_end_id

        dev = self.device
        if dev.type == "cuda":
            # No cuDNN attention in this process: it builds a plan for every new shape, and every prefill is one (a
            # new context length), on a turn's first audio; the memory-efficient kernel costs the same at every
            # length (bench/probes/prefill_time.py; figures: bench/results/graphs/README.md). A process-wide flag,
            # set once here rather than around each call: the prefill, decode and codec threads all run attention.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # One spare position past max_ctx: a frozen slot that rides along in a step writes its K/V at `pos`, which
        # is max_ctx for a slot whose context is exactly full.
        self.kv = KVCache.allocate(cfg.n_layer, max_slots + 1, self.max_ctx + 1, cfg.n_local_heads,
                                       cfg.head_dim, self.dtype, dev)
        # Separate fast caches for the decode batch and for prefill, so the two threads never share one.
        self.fast_kv = KVCache.allocate(cfg.n_fast_layer, max_slots + 1, cfg.num_codebooks,
                                            cfg.fast_n_local_heads, cfg.fast_head_dim, self.dtype, dev)
        self.fast_kv_prefill = KVCache.allocate(cfg.n_fast_layer, prefill_rows, cfg.num_codebooks,
                                                    cfg.fast_n_local_heads, cfg.fast_head_dim, self.dtype, dev)
        self.state = SlotState.allocate(max_slots + 1, self.rows, dev)
        self.rope = rope_table(self.max_ctx + 1, cfg.head_dim, cfg.rope_base, dev)
        self.fast_rope = rope_table(cfg.num_codebooks, cfg.fast_head_dim, cfg.rope_base, dev)
        self.fast_positions = torch.arange(cfg.num_codebooks, device=dev)
        self.fast_rows = torch.arange(max_slots + 1, device=dev)

        # Main-token candidates. S2: the semantic ids + <|im_end|> (everything else is masked to -inf by the
        # reference, so sampling over this subset is the same math with a 38x smaller sort).
        if self.format == "s2":
            self.main_ids = torch.cat([torch.arange(self.sem_begin, self.sem_end + 1, device=dev),
                                       torch.tensor([self.im_end], device=dev)])
            self.main_weight = self.model.head_weight()[self.main_ids].contiguous()
        else:
            self.main_ids = torch.arange(cfg.vocab_size, device=dev)
            self.main_weight = self.model.head_weight()
        fast_vocab = cfg.codebook_size
        if self.format == "s1":
            fast_vocab = min(fast_vocab, S1_FAST_VOCAB)
        if residual_limit is not None:
            fast_vocab = min(fast_vocab, residual_limit)
        self.fast_vocab = fast_vocab
        self.fast_ids = torch.arange(fast_vocab, device=dev)
        # S2 rounds temperature/top_p to the model dtype (bf16 in a bf16 run); S1 keeps float32.
        self.param_dtype = self.dtype if self.format == "s2" else torch.float32
        self.ras_temperature = self._round(RAS_TEMPERATURE)
        self.ras_top_p = self._round(RAS_TOP_P)

        self.noise: NoiseFn = exponential_noise
        self.trace: TraceFn | None = None  # debugging/test hook: receives intermediate tensors
        # CUDA-graph runners (rtts/engine/graphs/), set by capture_graphs(); until then everything runs eager.
        self.decode_runner: DecodeRunner | None = None
        self.frame_zero_runner: FrameZeroRunner | None = None
        self.prefill_runner: PrefillRunner | None = None
        self.host_pos = [0] * (max_slots + 1)  # host mirror of state.pos, advanced by prefill() and decode()
        # The scratch slot is permanently frozen, so padded rows never advance it.
        self.state.finish[self.scratch_slot] = FinishReason.CANCELLED

    # ------------------------------------------------------------------ CUDA graphs

    def capture_graphs(self, prefill: bool = True, prefill_token_budget: int = 2048) -> None:
        """Capture (CUDA only) and from now on replay the decode step (decode_batch) and turns' frame 0 (prefill_batch)
        from CUDA graphs, and with `prefill` also turn-sized prompt chunks of up to prefill_token_budget padded
        positions per batch. In that order; call it before any thread runs the engine."""
        self.release_graphs()  # an earlier capture's memory pools go before the new ones are taken
        decode = DecodeRunner(self)
        decode.capture()
        self.decode_runner = decode
        frame_zero = FrameZeroRunner(self)
        frame_zero.capture()
        self.frame_zero_runner = frame_zero
        if prefill:
            chunks = PrefillRunner(self, max_positions=prefill_token_budget)
            chunks.capture()
            self.prefill_runner = chunks if chunks.graphs else None

    def release_graphs(self) -> None:
        """Run everything eager again (a scheduler without graphs on an engine that an earlier one captured)."""
        self.decode_runner = self.frame_zero_runner = self.prefill_runner = None

    # ------------------------------------------------------------------ slot lifecycle

    @property
    def attention_kernel(self) -> bool:
        """Decode attention runs the CUDA kernel (lengths on the device: CUDA graphs need no KV-length buckets)."""
        cfg = self.config
        q = torch.empty(1, cfg.n_head, cfg.head_dim, dtype=self.dtype, device=self.device)
        return kernels.decode_attention_fast(q, self.kv.k[0])

    def _round(self, v: float) -> float:
        return float(torch.tensor(v, dtype=self.param_dtype).float())

    def reset_slot(self, slot: int) -> None:
        """Forget everything about a slot (a new stream takes it). KV needs no clearing: reads stop at `pos`."""
        mask = torch.zeros(self.max_slots + 1, dtype=torch.bool, device=self.device)
        mask[slot] = True
        self.state.reset(mask)
        self.host_pos[slot] = 0

    def set_params(self, slot: int, params: SamplingParams) -> None:
        """Per-turn settings; also restarts the turn's frame count and repetition windows."""
        params.validate()
        st, s = self.state, slot
        st.temperature[s] = self._round(params.temperature)
        st.top_p[s] = self._round(params.top_p)
        st.top_k[s] = min(params.top_k, 1 << 40) if params.top_k > 0 else 1 << 40  # past any vocabulary: no top-k
        st.penalty[s] = params.repetition_penalty
        st.ras_on[s] = params.ras
        st.max_frames[s] = params.max_frames
        if params.seed is not None:
            st.seed[s] = params.seed
            st.counter[s] = 0
        st.frame[s] = 0
        st.window[s] = 0
        st.ring[s] = 0
        st.ring_n[s] = 0
        st.finish[s] = 0

    def end_turn(self, slot: int) -> int:
        """After the host saw a slot's turn finish: re-read its true KV length (one sync per turn) and return it."""
        self.host_pos[slot] = int(self.state.pos[slot])
        return self.host_pos[slot]

    def rewind(self, slot: int, pos: int) -> None:
        """Forget the slot's context past `pos` (e.g. back to the end of its voice prompt). Entries past the length are
        never read, so this only moves the length."""
        if not 0 <= pos <= self.host_pos[slot]:
            raise ValueError(f"cannot rewind slot {slot} from {self.host_pos[slot]} to {pos}")
        self.host_pos[slot] = pos
        self.state.pos[slot] = pos

    def cancel(self, slot: int) -> None:
        """Freeze a slot now (device write only); later steps that still include it leave it untouched."""
        self.state.finish[slot] = FinishReason.CANCELLED

    # ------------------------------------------------------------------ prefill

    def room(self, slot: int) -> int:
        return self.max_ctx - self.host_pos[slot]

    @torch.inference_mode()
    def prefill(self, slot: int, columns: torch.Tensor, sample: bool = False) -> torch.Tensor | None:
        """Append `columns` [rows, T] to one slot's context, in chunks of `prefill_chunk` positions.

        With sample=True the last position's output samples frame 0 of a turn (call `set_params` first); returns
        that column [rows] (on the device) and stores it as the slot's next input.
        """
        T = columns.shape[1]
        self.check_room(slot, T, sample)
        out = None
        for start in range(0, T, self.prefill_chunk):
            last = start + self.prefill_chunk >= T
            res = self.prefill_batch([PrefillItem(slot, columns[:, start:start + self.prefill_chunk], sample and last)])
            out = None if res is None else res[0]
        return out

    def check_room(self, slot: int, positions: int, sample: bool) -> None:
        """Refuse, before touching the cache, a prefill that would not fit the slot's context."""
        if positions == 0 and sample:
            raise ValueError("cannot sample a frame from an empty prefill")
        # A sampled frame needs one more position to be fed.
        if self.host_pos[slot] + positions + (1 if sample else 0) > self.max_ctx:
            raise ContextFullError(
                f"{positions} new positions do not fit: the stream has {self.room(slot)} of {self.max_ctx} "
                "context positions left"
            )

    @torch.inference_mode()
    def prefill_batch(self, items: list[PrefillItem]) -> torch.Tensor | None:
        """One forward over several slots' prompt chunks (padded to the longest) -> frame-0 columns [n_sampled, rows]
        of the items with sample=True, in order (None if none samples).

        Padding tokens sit at the spare position `max_ctx` of their own slot: their K/V writes land where no real
        query reads, and their outputs are dropped.
        """
        if not items:
            return None
        if len(items) > self.prefill_rows:
            raise ValueError(f"at most {self.prefill_rows} prefill items per batch")
        for it in items:
            self.check_room(it.slot, it.columns.shape[1], it.sample)
        lengths = [it.columns.shape[1] for it in items]
        B, S = len(items), max(lengths)
        kv_len = max(self.host_pos[it.slot] + t for it, t in zip(items, lengths))
        dev = self.device
        graphs = self.prefill_runner if self.trace is None else None
        key = graphs.bucket(B, S, kv_len) if graphs is not None else None
        cols, positions, slots = self.pack_prefill(items, *(key[:2] if key else (B, S)))
        if graphs is not None and key is not None:  # padded to the graph's shape by pack_prefill
            hidden = graphs(cols, positions, slots, key)[:B]
            slots = slots[:B].to(dev)
        else:
            cols, positions, slots = (t.to(dev, non_blocking=True) for t in (cols, positions, slots))
            hidden = self.prefill_forward(cols, positions, slots, kv_len)
        for it, t in zip(items, lengths):
            self.host_pos[it.slot] += t
            self.state.pos[it.slot] = self.host_pos[it.slot]
        sampled = [i for i, it in enumerate(items) if it.sample]
        if not sampled:
            return None
        rows = torch.tensor(sampled, device=dev)
        last = torch.tensor([lengths[i] - 1 for i in sampled], device=dev)
        if self.frame_zero_runner is not None and self.trace is None:
            return self.frame_zero_runner(hidden[rows, last], slots[rows])
        return self.frame_zero(hidden[rows, last], slots[rows])

    def pack_prefill(self, items: list[PrefillItem], batch: int, length: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host cols [batch, rows, length], positions [batch, length] and slots [batch] (int64) of the items' next
        prompt pieces, padded: padding tokens at the spare position `max_ctx` of their row's slot (their K/V land
        where no real query reads), padded items on the scratch slot."""
        cols = torch.zeros(batch, self.rows, length, dtype=torch.int64)
        positions = torch.full((batch, length), self.max_ctx, dtype=torch.int64)
        slots = torch.full((batch,), self.scratch_slot, dtype=torch.int64)
        for i, it in enumerate(items):
            p0, t = self.host_pos[it.slot], it.columns.shape[1]
            cols[i, :, :t] = it.columns
            positions[i, :t] = torch.arange(p0, p0 + t)
            slots[i] = it.slot
        return cols, positions, slots

    def prefill_forward(self, cols: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        kv_len: int) -> torch.Tensor:
        """Graph-safe body of a prompt chunk's forward: cols [B, rows, S], positions [B, S] (padding at max_ctx),
        slots [B], all on the device -> pre-norm hidden [B, S, dim]; the K/V of every position are written.
        A kv_len beyond the rows' histories changes nothing: keys past a query's position are masked."""
        x = self.model.embed(cols)
        if self.trace is not None and x.shape[0] == 1:
            self.trace("embeddings", x[0])
        return self.model.forward_slow(x, self.rope[positions], self.kv.k, self.kv.v, slots, positions, kv_len)

    def frame_zero(self, hidden: torch.Tensor, slots: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Graph-safe body of a turn's frame 0: sample it from the prompt's last hidden state [B, dim] (slow head,
        fast transformer on the prefill thread's own fast cache, draws) and commit it to the slots -> columns
        [B, rows]. Rows with active == False (graph padding) sample but commit nothing."""
        col, _ = self._sample_frame(hidden, slots, self.fast_kv_prefill, decode=False)
        self._commit(slots, col, decode=False, active=active)
        return col

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode(self, slots: list[int], kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for `slots` (host list) -> (columns [B, rows], finish [B] int8), both on the device.

        `host_pos` is advanced as an upper bound (a frozen slot does not really move); `end_turn` re-reads it.
        """
        idx = torch.tensor(slots, device=self.device)
        if kv_len is None:
            kv_len = min(self.max_ctx + 1, max(self.host_pos[s] for s in slots) + 1)
        out = self.decode_step(idx, kv_len)
        for s in slots:
            self.host_pos[s] += 1
        return out

    def decode_batch(self, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode thread's step: launch one step for `slots` (host list) on the current CUDA stream, replayed
        from the decode graphs once captured -> (columns [>= n, rows], finish [>= n] int8) on the device; rows past
        len(slots) are padding. Nothing here waits for the GPU, and host_pos is left alone: the caller bounds the
        slots' KV lengths itself (kv_len: the longest, plus the position fed now)."""
        if self.decode_runner is not None:
            return self.decode_runner.step(slots, kv_len)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return self.decode_step(idx, min(kv_len, self.max_ctx + 1))

    def decode_step(self, slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph-safe body: slots [B] int64 on the device -> (columns [B, rows], finish [B] int8).

        Feeds each slot's `last_col` at its `pos`, samples the next frame, advances the slot state. A slot whose turn
        already finished is frozen: it may ride along in a step (the host learns about finishes one step late) but
        its state does not move. Its K/V write lands at `pos`, past its context, where the next prefill overwrites it.
        """
        st = self.state
        active = st.finish[slots] == FinishReason.RUNNING  # [B]
        cols_in = st.last_col[slots]  # [B, rows]
        positions = st.pos[slots][:, None]  # [B, 1]
        x = self.model.embed(cols_in[:, :, None])
        hidden = self.model.forward_slow(x, self.rope[positions], self.kv.k, self.kv.v, slots, positions, kv_len)
        col, _ = self._sample_frame(hidden[:, 0], slots, self.fast_kv, decode=True)
        st.pos[slots] = positions[:, 0] + active.long()
        finish = self._commit(slots, col, decode=True, active=active)
        return col, finish

    # ------------------------------------------------------------------ one frame

    def _sample_frame(
        self,
        hidden: torch.Tensor,  # [B, dim] pre-norm slow output of the last position
        slots: torch.Tensor,  # [B]
        fast_kv: KVCache,
        decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (column [B, rows] = [token, c0..c9], main token [B])."""
        st, m, B = self.state, self.model, hidden.shape[0]
        normed, fast_in = m.slow_head(hidden)
        if self.trace is not None:
            self.trace("hidden_normed", normed)
            self.trace("fast_in", fast_in)
            self.trace("slow_logits", normed @ m.head_weight().T)
        seed, counter = st.seed[slots], st.counter[slots]
        temp, top_p, top_k = st.temperature[slots], st.top_p[slots], st.top_k[slots]
        logits = normed @ self.main_weight.T  # [B, n_main]

        if self.format == "s2":
            tok = self.main_ids[self._sample(logits, temp, top_p, top_k, seed, counter, DRAW_MAIN, self.main_ids)]
            if decode:
                ones = torch.ones_like(temp)
                hi = self._sample(logits, ones * self.ras_temperature, ones * self.ras_top_p, top_k, seed, counter,
                                  DRAW_RAS, self.main_ids)
                tok_hi = self.main_ids[hi]
                tok = sampling.ras_choice(tok, tok_hi, st.window[slots][..., 0], self.sem_begin, self.sem_end,
                                          st.ras_on[slots])
            c0 = (tok - self.sem_begin).clamp(0, self.config.codebook_size - 1)
        else:
            if decode:  # frame 0 gets no penalty
                ids = sampling.penalty_main_ids(st.ring[slots], st.ring_n[slots])
                logits = sampling.repetition_penalty(logits, ids, st.penalty[slots])
                if self.trace is not None:
                    self.trace("slow_logits_penalized", logits)
            tok = self._sample(logits, temp, top_p, top_k, seed, counter, DRAW_MAIN, self.main_ids)
            # S1: no upper clamp on c0 (a non-semantic token makes a text position whose codes are ignored).
            c0 = (tok - self.sem_begin).clamp(min=0)

        # Fast transformer: positions 0 (slow hidden) and 1 (embedding of c0) run together, then 2..9 one by one.
        rows = self.fast_rows[:B]
        codes = [c0]
        x = torch.stack([fast_in, m.fast_embeddings(c0.clamp(max=self.config.codebook_size - 1))], dim=1)
        pos = self.fast_positions[None, 0:2].expand(B, 2).contiguous()  # (the cache-store kernel wants [B, S])
        for k in range(1, self.config.num_codebooks):
            if k > 1:
                x = m.fast_embeddings(codes[-1])[:, None]
                pos = self.fast_positions[None, k:k + 1].expand(B, 1).contiguous()
            fl = m.forward_fast(x, self.fast_rope[pos[:1]], fast_kv.k, fast_kv.v, rows, pos, k + 1)[:, -1]
            if self.trace is not None:
                self.trace("fast_logits", fl)
            fl = fl[:, : self.fast_vocab]
            if self.format == "s1" and decode:
                fl = sampling.repetition_penalty(fl, st.ring[slots][:, :, k + 1], st.penalty[slots])
                if self.trace is not None:
                    self.trace("fast_logits_penalized", fl)
            codes.append(self._sample(fl, temp, top_p, top_k, seed, counter, DRAW_RAS + k, self.fast_ids))
        col = torch.stack([tok] + codes, dim=1)
        return col, tok

    def _sample(self, logits: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                seeds: torch.Tensor, counters: torch.Tensor, draw_id: int, ids: torch.Tensor) -> torch.Tensor:
        """Filter (top-p/top-k at T = 1, then temperature) and draw over `ids` -> [B] indices into ids. With the
        default noise it is one kernel on the GPU (kernels.draw.sample); a substituted noise function (tests replaying
        fixture noise) goes through the torch ops."""
        if self.noise is exponential_noise:
            return draw.sample(logits, temp, top_p, top_k, seeds, counters, draw_id, ids)
        probs = sampling.filtered_probs(logits, temp, top_p, top_k)
        return sampling.race(probs, self.noise(seeds, counters, draw_id, ids))

    def _commit(
        self, slots: torch.Tensor, col: torch.Tensor, decode: bool, active: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Store the new column as the slot's next input and advance frame/RNG/window state -> finish [B] int8.

        Rows with active == False keep all their state (and report their existing finish reason).
        """
        st = self.state
        if active is None:
            active = torch.ones_like(slots, dtype=torch.bool)
        act = active[:, None]
        tok = col[:, 0]
        st.last_col[slots] = torch.where(act, col, st.last_col[slots])
        frame = st.frame[slots] + active.long()
        st.frame[slots] = frame
        st.counter[slots] = st.counter[slots] + active.long()
        if decode:
            if self.format == "s2":
                kernels.token_window_shift(st.window, slots, tok[:, None].to(torch.int32), active)
            else:
                n = st.ring_n[slots]
                at = n % PENALTY_WINDOW
                st.ring[slots, at] = torch.where(act, col, st.ring[slots, at])
                st.ring_n[slots] = n + active.long()
        running = torch.full_like(tok, FinishReason.RUNNING, dtype=torch.int8)
        finish = torch.where(frame >= st.max_frames[slots], torch.full_like(running, FinishReason.LENGTH), running)
        # The next step feeds this column at position pos; it must exist.
        finish = torch.where(st.pos[slots] >= self.max_ctx, torch.full_like(running, FinishReason.CONTEXT), finish)
        if decode:  # the prefill frame's token is never checked (reference behaviour)
            finish = torch.where(tok == self.im_end, torch.full_like(running, FinishReason.STOP), finish)
        finish = torch.where(active, finish, st.finish[slots])
        st.finish[slots] = finish
        return finish
