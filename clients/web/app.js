// Browser demo: one live session per click over /v1/tts/live (binary msgpack), PCM played as it arrives.
"use strict";
const $ = (id) => document.getElementById(id);
const RATE = 24000;
let ctx = null, ws = null, playAt = 0;
let sources = [];  // scheduled audio of the current session (cancel stops what has not played yet)

function log(msg) { $("log").textContent = msg + "\n" + $("log").textContent.slice(0, 4000); }

fetch("/v1/info").then((r) => r.json()).then((info) => {
  if (info.default_model) {
    $("warn").style.display = "block";
    $("warn").textContent = "This server runs its embedded default model: tiny random weights. It produces noise, " +
      "not speech. Start it with --checkpoint pointing at a real S2-Pro or S1-mini checkpoint for real voices.";
  }
  log(`model ${info.model}, up to ${info.max_running} concurrent streams`);
});

function play(pcmBytes) {
  const n = pcmBytes.byteLength >> 1;
  const view = new DataView(pcmBytes.buffer, pcmBytes.byteOffset, n * 2);
  const buf = ctx.createBuffer(1, n, RATE);
  const ch = buf.getChannelData(0);
  for (let i = 0; i < n; i++) ch[i] = view.getInt16(2 * i, true) / 32768;
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(ctx.destination);
  playAt = Math.max(playAt, ctx.currentTime + 0.02);
  src.start(playAt);
  playAt += n / RATE;
  sources.push(src);
  src.onended = () => { sources = sources.filter((s) => s !== src); };
}

function stopAudio() {
  for (const s of sources) { try { s.stop(); } catch (e) { /* already ended */ } }
  sources = [];
  playAt = 0;
}

$("speak").onclick = () => {
  ctx = ctx || new AudioContext();
  if (ws) { ws.onmessage = null; ws.onclose = null; ws.close(); }  // one session at a time
  stopAudio();
  const proto = location.protocol === "https:" ? "wss" : "ws";
  // Browsers cannot set an Authorization header on a WebSocket: the key travels as a query parameter instead.
  const key = $("key").value ? `?api_key=${encodeURIComponent($("key").value)}` : "";
  ws = new WebSocket(`${proto}://${location.host}/v1/tts/live${key}`);
  ws.binaryType = "arraybuffer";
  let t0 = 0, first = true, samples = 0;
  ws.onopen = () => {
    const req = { text: "", format: "pcm", sample_rate: RATE, latency: $("latency").value };
    if ($("voice").value) req.reference_id = $("voice").value;
    ws.send(MessagePack.encode({ event: "start", request: req }));
    t0 = performance.now();
    ws.send(MessagePack.encode({ event: "text", text: $("text").value }));
    ws.send(MessagePack.encode({ event: "stop" }));
    $("cancel").disabled = false;
  };
  ws.onmessage = (m) => {
    const ev = MessagePack.decode(new Uint8Array(m.data));
    if (ev.event === "audio") {
      if (first) { $("ttfa").textContent = `${Math.round(performance.now() - t0)} ms`; first = false; }
      samples += ev.audio.byteLength >> 1;
      $("dur").textContent = `${(samples / RATE).toFixed(2)} s`;
      play(ev.audio);
    } else if (ev.event === "finish") {
      log(ev.reason === "error" ? `error: ${ev.message}` : ev.reason === "cancelled" ? "cancelled" : "finished");
      $("cancel").disabled = true;
      ws.close();
    }
  };
  ws.onerror = () => log("connection error (is an API key required?)");
  ws.onclose = (e) => {
    if (e.code !== 1000 && e.code !== 1005) log(`connection closed (${e.code}${e.reason ? ": " + e.reason : ""})`);
    $("cancel").disabled = true;
  };
};

$("cancel").onclick = () => {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(MessagePack.encode({ event: "cancel" }));
  stopAudio();
};
