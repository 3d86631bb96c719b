// Browser demo: one live session per Speak over /v1/tts/live (binary msgpack), 24 kHz PCM played as it arrives, its
// waveform drawn as it comes, a WAV of it to download; the stored voices to pick from, and cloning a voice from an
// uploaded clip or a microphone recording (MediaRecorder: WebM/Opus in Chromium and Firefox).
"use strict";
const $ = (id) => document.getElementById(id);
const RATE = 24000;
const BLOCK = RATE / 100;  // one waveform column per 10 ms of audio
const MAX_RECORD_SECONDS = 30;

let ctx = null;      // the AudioContext, made on the first Speak (browsers allow audio after a click)
let ws = null;       // the socket of the current run
let run = null;      // what the current run received (newRun)
let sources = [];    // its scheduled audio (Cancel stops what has not played yet)
let downloadUrl = null;

function log(msg) { $("log").textContent = `${new Date().toLocaleTimeString()} ${msg}\n` + $("log").textContent.slice(0, 6000); }

function status(msg, error = false) {
  $("status").textContent = msg;
  $("status").className = error ? "err" : "";
}

function authHeaders() {
  const key = $("key").value;
  return key ? { Authorization: `Bearer ${key}` } : {};
}

fetch("/v1/info").then((r) => r.json()).then((info) => {
  if (info.default_model) {  // what the default voice is: the server's note, from the voice's own README
    $("about").style.display = "block";
    $("about").textContent = `This server speaks with its ${info.note} Start it with --checkpoint pointing at an ` +
      "S2-Pro or S1-mini checkpoint for the release models.";
  }
  log(`model ${info.model}, up to ${info.max_running} concurrent streams`);
}).catch((e) => log(`info: ${e}`));

// ------------------------------------------------------------------------------------------------------------ voices

async function loadVoices(select) {
  try {
    const r = await fetch("/v1/references/list", { headers: authHeaders() });
    const body = await r.json();
    if (!r.ok) { log(`voices: ${body.message || "HTTP " + r.status}`); return; }
    const sel = $("voice");
    const keep = select ?? sel.value;
    sel.length = 1;  // "default" stays
    for (const v of body.references) sel.add(new Option(v.id, v.id));
    sel.value = [...sel.options].some((o) => o.value === keep) ? keep : "";
    sel.dataset.loaded = String(body.references.length);
  } catch (e) {
    log(`voices: ${e}`);
  }
}

loadVoices();
$("refresh").onclick = () => loadVoices();
$("key").onchange = () => loadVoices();

// ------------------------------------------------------------------------------------------------------ one session

function newRun() {
  return { t0: 0, first: true, samples: 0, chunks: 0, pcm: [], peaks: [], blockPeak: 0, blockFill: 0, playStart: null,
           playEnd: 0, ended: false };
}

function resetStats() {
  // Every run starts from nothing: a run that fails shows its own (empty) counts, not the last run's.
  $("ttfa").textContent = "–";
  $("chunks").textContent = "0";
  $("dur").textContent = "0.00 s";
  $("download").hidden = true;
  if (downloadUrl) { URL.revokeObjectURL(downloadUrl); downloadUrl = null; }
  drawWave();
}

function onAudio(r, bytes) {
  const n = bytes.byteLength >> 1;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
  const samples = new Int16Array(n);
  for (let i = 0; i < n; i++) samples[i] = view.getInt16(2 * i, true);
  r.pcm.push(samples);
  r.samples += n;
  r.chunks += 1;
  for (let i = 0; i < n; i++) {  // waveform: the peak of every 10 ms
    r.blockPeak = Math.max(r.blockPeak, Math.abs(samples[i]) / 32768);
    if (++r.blockFill === BLOCK) { r.peaks.push(r.blockPeak); r.blockPeak = 0; r.blockFill = 0; }
  }
  $("chunks").textContent = String(r.chunks);
  $("dur").textContent = `${(r.samples / RATE).toFixed(2)} s`;
  play(r, samples);
}

function play(r, samples) {
  const buf = ctx.createBuffer(1, samples.length, RATE);
  const ch = buf.getChannelData(0);
  for (let i = 0; i < samples.length; i++) ch[i] = samples[i] / 32768;
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(ctx.destination);
  const at = Math.max(r.playEnd, ctx.currentTime + 0.02);
  if (r.playStart === null) r.playStart = at;
  src.start(at);
  r.playEnd = at + samples.length / RATE;
  sources.push(src);
  src.onended = () => { sources = sources.filter((s) => s !== src); };
}

function stopAudio() {
  for (const s of sources) { try { s.stop(); } catch (e) { /* already ended */ } }
  sources = [];
}

function closeSocket() {
  if (!ws) return;
  ws.onmessage = ws.onclose = ws.onerror = null;
  ws.close();
  ws = null;
}

function offerDownload(r) {
  if (!r.samples) return;
  downloadUrl = URL.createObjectURL(wavBlob(r.pcm, r.samples, RATE));
  const a = $("download");
  a.href = downloadUrl;
  a.download = `rtts-${new Date().toISOString().replace(/[:.]/g, "-")}.wav`;
  a.hidden = false;
}

function wavBlob(chunks, n, rate) {
  const out = new DataView(new ArrayBuffer(44 + 2 * n));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) out.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * n, true); text(8, "WAVEfmt ");
  out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);  // PCM, mono
  out.setUint32(24, rate, true); out.setUint32(28, 2 * rate, true); out.setUint16(32, 2, true); out.setUint16(34, 16, true);
  text(36, "data"); out.setUint32(40, 2 * n, true);
  let at = 44;
  for (const c of chunks) for (let i = 0; i < c.length; i++, at += 2) out.setInt16(at, c[i], true);
  return new Blob([out.buffer], { type: "audio/wav" });
}

function finish(r, msg, error = false) {
  r.ended = true;
  status(msg, error);
  log(msg);
  $("cancel").disabled = true;
  offerDownload(r);
}

$("speak").onclick = () => {
  ctx = ctx || new AudioContext();
  if (ctx.state === "suspended") ctx.resume();
  closeSocket();  // one session at a time
  stopAudio();
  const r = run = newRun();
  resetStats();
  status("connecting…");
  const proto = location.protocol === "https:" ? "wss" : "ws";
  // Browsers cannot set an Authorization header on a WebSocket: the key travels as a query parameter instead.
  const key = $("key").value ? `?api_key=${encodeURIComponent($("key").value)}` : "";
  const sock = ws = new WebSocket(`${proto}://${location.host}/v1/tts/live${key}`);
  sock.binaryType = "arraybuffer";
  sock.onopen = () => {
    const req = { text: "", format: "pcm", sample_rate: RATE, latency: $("latency").value };
    if ($("voice").value) req.reference_id = $("voice").value;
    sock.send(MessagePack.encode({ event: "start", request: req }));
    r.t0 = performance.now();
    sock.send(MessagePack.encode({ event: "text", text: $("text").value }));
    sock.send(MessagePack.encode({ event: "stop" }));
    $("cancel").disabled = false;
    status("speaking…");
  };
  sock.onmessage = (m) => {
    const ev = MessagePack.decode(new Uint8Array(m.data));
    if (ev.event === "audio") {
      if (r.first) { $("ttfa").textContent = `${Math.round(performance.now() - r.t0)} ms`; r.first = false; }
      onAudio(r, ev.audio);
    } else if (ev.event === "finish") {
      if (ev.reason === "error") finish(r, `error: ${ev.message}`, true);
      else finish(r, ev.reason === "cancelled" ? "cancelled" : "finished");
      closeSocket();
    }
  };
  sock.onerror = () => { if (!r.ended) finish(r, "connection error (is an API key required?)", true); };
  sock.onclose = (e) => { if (!r.ended) finish(r, `connection closed (${e.code}${e.reason ? ": " + e.reason : ""})`, true); };
};

$("cancel").onclick = () => {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(MessagePack.encode({ event: "cancel" }));
  stopAudio();
  status("cancelling…");
};

// ------------------------------------------------------------------------------------ waveform and level, as it plays

function drawWave() {
  const c = $("wave"), g = c.getContext("2d");
  const w = c.width, h = c.height;
  g.clearRect(0, 0, w, h);
  if (!run || !run.peaks.length) { $("meter-fill").style.width = "0"; return; }
  const peaks = run.peaks, step = Math.min(2, w / peaks.length);
  const played = run.playStart === null || !ctx ? 0 : Math.max(0, ctx.currentTime - run.playStart);
  const playedBlocks = Math.min(peaks.length, Math.floor(played * 100));
  for (let i = 0; i < peaks.length; i++) {
    const y = Math.max(1, peaks[i] * (h - 4));
    g.fillStyle = i < playedBlocks ? "#2563eb" : "#93c5fd";
    g.fillRect(i * step, (h - y) / 2, Math.max(1, step - 0.5), y);
  }
  const level = playedBlocks > 0 && playedBlocks < peaks.length ? peaks[playedBlocks] : 0;
  $("meter-fill").style.width = `${Math.round(100 * Math.min(1, level * 1.5))}%`;
}

(function animate() { drawWave(); requestAnimationFrame(animate); })();

// -------------------------------------------------------------------------------------------------- cloning a voice

let recorded = null;  // the last microphone recording (a Blob), unless a file was chosen after it
let recorder = null;

function cloneStatus(msg, ok) {
  $("clone-status").textContent = msg;
  $("clone-status").className = ok === undefined ? "" : ok ? "ok" : "err";
}

$("clone-file").onchange = () => { recorded = null; $("rec-preview").hidden = true; $("rec-time").textContent = ""; };

$("record").onclick = async () => {
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    cloneStatus(`no microphone: ${e.message || e}`, false);
    return;
  }
  const type = ["audio/webm;codecs=opus", "audio/webm", "audio/ogg;codecs=opus", "audio/mp4"]
    .find((t) => MediaRecorder.isTypeSupported(t));
  const rec = recorder = new MediaRecorder(stream, type ? { mimeType: type } : undefined);
  const parts = [];
  const t0 = performance.now();
  const timer = setInterval(() => {
    const s = (performance.now() - t0) / 1000;
    $("rec-time").textContent = `● ${s.toFixed(1)} s`;
    if (s >= MAX_RECORD_SECONDS) rec.stop();
  }, 100);
  rec.ondataavailable = (e) => { if (e.data.size) parts.push(e.data); };
  rec.onstop = () => {
    clearInterval(timer);
    stream.getTracks().forEach((t) => t.stop());
    recorded = new Blob(parts, { type: rec.mimeType });
    $("clone-file").value = "";
    const p = $("rec-preview");
    p.src = URL.createObjectURL(recorded);
    p.hidden = false;
    $("rec-time").textContent = `recorded ${((performance.now() - t0) / 1000).toFixed(1)} s (${rec.mimeType})`;
    $("record").disabled = false;
    $("stop-record").disabled = true;
  };
  rec.start(250);
  $("record").disabled = true;
  $("stop-record").disabled = false;
  cloneStatus("recording…");
};

$("stop-record").onclick = () => { if (recorder && recorder.state !== "inactive") recorder.stop(); };

function recordingName(blob) {
  const ext = blob.type.includes("webm") ? "webm" : blob.type.includes("ogg") ? "ogg" : blob.type.includes("mp4") ? "m4a" : "bin";
  return `recording.${ext}`;
}

$("clone").onclick = async () => {
  const id = $("clone-id").value.trim(), text = $("clone-text").value.trim();
  const file = $("clone-file").files[0];
  const audio = file || recorded;
  if (!id) return cloneStatus("give the voice an id", false);
  if (!audio) return cloneStatus("choose a clip or record one", false);
  if (!text) return cloneStatus("type exactly what the clip says", false);
  const form = new FormData();
  form.append("id", id);
  form.append("text", text);
  form.append("audio", audio, file ? file.name : recordingName(audio));
  cloneStatus("uploading…");
  $("clone").disabled = true;
  try {
    const r = await fetch("/v1/references/add", { method: "POST", headers: authHeaders(), body: form });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      cloneStatus(body.message || `HTTP ${r.status}`, false);
    } else {
      cloneStatus(`saved voice ${id}`, true);
      log(`voice ${id} saved (${body.reference ? body.reference.frames + " frames" : "ok"})`);
      await loadVoices(id);
    }
  } catch (e) {
    cloneStatus(`upload failed: ${e}`, false);
  } finally {
    $("clone").disabled = false;
  }
};
