"""Everything a server process owns: model, engine, codec, scheduler threads, voices, metrics, limits."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rtts import env
from rtts.allocator import IdleTrimmer
from rtts.engine.engine import DEFAULT_PREFILL_ROWS, Engine
from rtts.metrics import Metrics
from rtts.model.codec import Codec, load_codec
from rtts.model.loading import LoadedModel, load_model
from rtts.model.prompt import Reference
from rtts.model.quant import quantize_model_
from rtts.pingpong import NoSlotError, Scheduler, SchedulerConfig, StreamHandle
from rtts.request import Limits
from rtts.startup import freeze_startup_objects, set_switch_interval
from rtts.tools.demo_voice import demo_voice_dir, summary
from rtts.types import SamplingParams
from rtts.voices import VoiceStore, reference_encoder

log = logging.getLogger("rtts.server")


# `rtts serve` exits with this status when a worker thread died (ServerConfig.exit_on_failure), after giving the
# clients FAILURE_GRACE seconds to receive the errors their sessions ended with.
EXIT_WORKER_FAILED = 3
FAILURE_GRACE = 2.0
SLOT_WAIT = 2.0  # seconds a new session waits for a slot at capacity (Runtime.open_stream)
# The refusal of a new session (socket, start, HTTP request) while the server drains (rtts.ws.server).
DRAINING_MESSAGE = ("server is draining (shutting down) and takes no new sessions; retry: a load balancer routes "
                    "it to another worker")
RECLAIM_ANYWAY = 0.5  # seconds without a slot after which open_stream takes back an idle stream despite pending frees


@dataclass(frozen=True)
class ServerConfig:
    checkpoint: str | None = None  # None: the packaged demo voice (rtts.tools.demo_voice)
    host: str = "127.0.0.1"
    port: int = 8080
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    max_running: int = 64
    max_ctx: int = 4096
    # prompts per prefill batch (Engine.prefill_rows): a burst of turns waits in batches of it
    prefill_rows: int = DEFAULT_PREFILL_ROWS
    api_keys: tuple[str, ...] = ()
    voices_dir: str | None = None
    max_reference_seconds: float = 60.0
    limits: Limits = field(default_factory=Limits)
    cuda_graphs: bool = True
    warmup: bool = True
    # Once started, keep everything the process holds out of the cyclic garbage collector (freeze_startup_objects).
    # A process-wide setting: `rtts serve` turns it on; tests that build several runtimes in one process leave it off.
    freeze_gc: bool = False
    codec_graphs: bool = True  # audio chunks decoded from CUDA graphs (SchedulerConfig.codec_graphs)
    codec_tf32: bool = True  # the codec's convolutions on TF32 tensor cores on CUDA (SchedulerConfig.codec_tf32)
    codec_dtype: str = "auto"  # the audio decode's precision on CUDA (decode_codec); references encode in float32
    prefill_graphs: bool = True  # prompt chunks replayed from CUDA graphs (SchedulerConfig.prefill_graphs)
    fp8: bool = False  # quantize the transformer linears at load (`rtts quantize` does it ahead of time)
    # End the process (status EXIT_WORKER_FAILED) once the server failed, so that a supervisor restarts it. A
    # process-wide action: `rtts serve` turns it on; in-process servers (tests) watch Runtime.failure instead.
    exit_on_failure: bool = False
    # Give freed heap memory back to the OS whenever no turn has generated for a while (rtts.allocator): a
    # process-wide action, which `rtts serve` turns on.
    trim_when_idle: bool = False
    # SIGTERM: seconds open sessions get to finish before the rest end with finish/error (rtts.ws.server)
    drain_grace: float = 30.0


def decode_codec(codec: Codec, dtype: str) -> Codec:
    """The codec the scheduler decodes audio with: `codec` itself, or on CUDA a copy in half precision (weights and
    streaming state; the Snake kernel and cuDNN take either). Reference encoding keeps the float32 codec: a voice's
    codes are a prompt shared by every session, computed once."""
    cuda = codec.device.type == "cuda"
    # auto: float16 on CUDA, 1.4x faster than TF32 at 47.7 dB SNR from true float32 (bench/results/codec/); bfloat16
    # is as fast but 30 dB.
    want = {"auto": torch.float16 if cuda else torch.float32, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[dtype]
    if want == codec.dtype:
        return codec
    if not cuda:
        raise ValueError(f"--codec-dtype {dtype} needs --device cuda (a CPU decodes audio in float32)")
    log.info("audio decode in %s (a copy of the codec; references encode in %s)", want, codec.dtype)
    # The copy leaves out the encoding half (encoder, downsample, pre-module): the decode never runs it.
    encoding = (codec.encoder, codec.quantizer.downsample, codec.quantizer.pre_module)
    return copy.deepcopy(codec, {id(m): None for m in encoding}).to(want)


class Runtime:
    def __init__(self, config: ServerConfig, loaded: LoadedModel | None = None, codec: Codec | None = None) -> None:
        self.config = config
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA device is available")
        if device.type == "cpu" and (threads := env.cpu_threads()) is not None:
            # Process-wide; measured on a 2-core box with the demo voice: one thread each for the decode and codec
            # threads streams faster than both sharing two (bench/results/cpu/).
            torch.set_num_threads(threads)
            log.info("torch CPU threads: %d (RTTS_CPU_THREADS overrides)", threads)
        self.checkpoint = Path(config.checkpoint) if config.checkpoint else None
        self.default_model = loaded is None and self.checkpoint is None
        self.demo_dir = demo_voice_dir() if self.default_model else None
        # What the log, /v1/info and the demo page say about the default model: the demo voice's own README.
        self.model_summary = summary(self.demo_dir) if self.demo_dir else ""
        if loaded is None:
            ckpt = self.checkpoint or self.demo_dir
            assert ckpt is not None
            dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
                     "bfloat16": torch.bfloat16, "float32": torch.float32}[config.dtype]
            t0 = time.perf_counter()
            loaded = load_model(ckpt, device=device, dtype=dtype)
            if config.fp8:  # a checkpoint already in FP8 has nothing left to quantize
                quantize_model_(loaded.model)
            codec = load_codec(ckpt, device=device, dtype=torch.float32)
            log.info("loaded %s (%s, %s) in %.1f s", ckpt, loaded.config.model_type, dtype, time.perf_counter() - t0)
        assert codec is not None
        self.loaded, self.codec = loaded, codec
        self.model_format = loaded.config.format
        self.engine = Engine(loaded, max_slots=config.max_running, max_ctx=config.max_ctx,
                             prefill_rows=config.prefill_rows)
        sched = SchedulerConfig(cuda_graphs=config.cuda_graphs, codec_graphs=config.codec_graphs,
                                prefill_graphs=config.prefill_graphs, codec_tf32=config.codec_tf32)
        self.scheduler = Scheduler(self.engine, decode_codec(codec, config.codec_dtype), sched)
        self.voices = VoiceStore(config.voices_dir, reference_encoder(codec, config.max_reference_seconds),
                                 codebooks=codec.config.num_codebooks)
        self._idle: OrderedDict[object, Callable[[], None]] = OrderedDict()  # idle_stream
        self.metrics = Metrics(self)
        self.ready = False
        # A balancer reads these through /v1/health (health()): draining = SIGTERM received, finishing open sessions;
        # failure = why the server can no longer synthesize (a worker thread died), which ends the process.
        self.draining = False
        self.failure: str | None = None
        # Called once (from the failing thread) with the reason, when the server fails.
        self.failure_hooks: list[Callable[[str], None]] = []
        self.trimmer: IdleTrimmer | None = None
        self.scheduler.on_failure = self.fail
        self.http_requests = 0  # HTTP requests in progress, probes aside (rtts.ws.app): a drain waits for them

    @property
    def sample_rate(self) -> int:
        return self.codec.config.sample_rate

    def start(self) -> None:
        """Capture graphs, start the threads, and run one synthesis so the first client pays no warm-up."""
        self.scheduler.start()
        if self.config.warmup:
            # One turn per latency mode, long enough for every chunk size: the first client meets no cold shape
            # (codec chunk lengths, prefill lengths, lazy CUDA/cuDNN initialisation).
            t0 = time.perf_counter()
            handle = self.scheduler.open()
            try:
                for latency in ("low", "balanced", "normal"):
                    for _ in handle.speak("Warm up the server.", SamplingParams(seed=0, max_frames=20),
                                          latency=latency):
                        pass
            finally:
                handle.close()
            log.info("warm-up synthesis took %.2f s", time.perf_counter() - t0)
        if self.config.freeze_gc:
            freeze_startup_objects()
        set_switch_interval()
        if self.config.trim_when_idle:
            self.trimmer = IdleTrimmer(lambda: not self.scheduler.generating).start()
        self.ready = True
        if self.demo_dir is not None:
            log.info("serving the embedded demo voice %s (%s, %d Hz): %s Pass --checkpoint DIR (fishaudio/s2-pro or "
                     "openaudio-s1-mini) for the release models.", self.demo_dir, self.loaded.config.model_type,
                     self.sample_rate, self.model_summary)

    def fail(self, reason: str) -> None:
        """The server can no longer synthesize (the scheduler's worker thread died): /v1/health answers 503, the hooks
        run, and with exit_on_failure the process ends after FAILURE_GRACE seconds."""
        if self.failure is not None:
            return
        self.failure = reason
        log.critical("server failed: %s", reason)
        for hook in self.failure_hooks:
            try:
                hook(reason)
            except Exception:
                log.exception("failure hook failed")
        if self.config.exit_on_failure:
            threading.Thread(target=_exit_after_failure, name="rtts-exit", daemon=True).start()

    def health(self) -> tuple[int, str]:
        """(HTTP status, state) for /v1/health: 200 only while new sessions can be served."""
        if self.failure is not None:
            return 503, "failed"
        if not self.ready:
            return 503, "starting"
        if self.draining:
            return 503, "draining"
        return 200, "ok"

    async def open_stream(self, references: Sequence[Reference] = ()) -> StreamHandle:
        """A stream for a session; when every slot is busy, take back the stream an idle socket kept longest (see
        idle_stream) and wait up to SLOT_WAIT for a slot. A slot given back (that, a socket's voice change, a
        barge-in's close before its reconnect) is freed asynchronously, once no decode step in flight uses it:
        without the wait the very next open is refused at capacity. NoSlotError after that."""
        t0 = last = time.monotonic()
        while True:
            try:
                return self.scheduler.open(references)
            except NoSlotError:
                now = time.monotonic()
                # Take back an idle stream only while no closed stream's slot is on its way back (this socket's
                # own at a voice change, one taken back just before): that slot is this session's to wait for, and
                # however late it frees (a long decode step), one session takes back at most one stream. The count
                # is the server's, so a slot on its way back may go to another opener: after RECLAIM_ANYWAY
                # without a slot, take one back regardless (then again each RECLAIM_ANYWAY).
                if self._idle and (self.scheduler.releasing == 0 or now - last >= RECLAIM_ANYWAY):
                    _, reclaim = self._idle.popitem(last=False)
                    reclaim()
                    last = now
                    log.info("took back an idle socket's stream for a new session")
                elif now - t0 >= SLOT_WAIT:
                    raise
                await asyncio.sleep(0.01)

    def idle_stream(self, owner: object, reclaim: Callable[[], None] | None) -> None:
        """A socket keeps its stream between sessions (the next one reuses its prefilled voice), which holds a slot.
        `reclaim` (None: the stream is in use again, or gone) closes it when a new session finds no free slot:
        capacity counts running sessions, not sockets that have spoken. Least recently idle first."""
        self._idle.pop(owner, None)
        if reclaim is not None:
            self._idle[owner] = reclaim

    def stop(self) -> None:
        self.ready = False
        if self.trimmer is not None:
            self.trimmer.stop()
        self.scheduler.stop()
        self.metrics.close()


def _exit_after_failure() -> None:
    """End a failed server's process: the sessions' error finishes go out first (FAILURE_GRACE), then exit without
    waiting on anything the dead worker holds."""
    time.sleep(FAILURE_GRACE)
    log.critical("exiting with status %d: a worker thread died (see above)", EXIT_WORKER_FAILED)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_WORKER_FAILED)
