"""Reference voices on a real server (tiny golden checkpoint, CPU): `/v1/references/*` and its errors, stored voices
named by `reference_id` (also as a list of speakers), a socket's prefilled voice and its deletion. PROTOCOL.md §6.
"""

from __future__ import annotations

import time

import httpx
import ormsgpack
from conftest import REF_TEXT, greedy
from liveserver import STOP, LiveServer, expect_error, session, start_msg, text_msg, until_finish


def test_references_http_errors(srv: LiveServer) -> None:
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        r = h.post("/v1/references/add", data={"id": "bad id!", "text": "x"}, files={"audio": ("a.wav", b"xx")})
        assert r.status_code == 400 and "id" in r.json()["message"]
        r = h.post("/v1/references/add", data={"id": "v", "text": "x"}, files={"audio": ("a.wav", b"not audio")})
        assert r.status_code == 400 and "decode" in r.json()["message"]
        r = h.post("/v1/references/add", content=b"\xc1", headers={"content-type": "application/msgpack"})
        assert r.status_code == 400
        r = h.post("/v1/references/add", content=b"--x\r\nnot a part", headers={
            "content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 400 and r.json()["status"] == 400  # JSON, like every other error
        r = h.post("/v1/references/add", content=ormsgpack.packb({"id": None, "audio": b"x", "text": "t"}),
                   headers={"content-type": "application/msgpack"})
        assert r.status_code == 400 and "id must be a string" in r.json()["message"]
        big = b"{" + b" " * (2 * srv.config.limits.max_reference_bytes) + b"}"
        r = h.post("/v1/references/add", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = h.request("DELETE", "/v1/references/delete")
        assert r.status_code == 400 and "id" in r.json()["message"]


def test_reference_id_lists_voice_every_speaker(srv: LiveServer, ref_wav: bytes) -> None:
    """reference_id as a list (multi-speaker): every id is a speaker's voice, so every id must exist."""
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        r = h.post("/v1/references/add", data={"id": "speaker-a", "text": REF_TEXT},
                   files={"audio": ("a.wav", ref_wav)})
        assert r.status_code == 200, r.text
    with srv.connect() as ws:
        ws.send(start_msg(reference_id=["speaker-a", "no-such-voice"]))
        expect_error(ws, "no-such-voice")
        audio, fin = session(ws, ["<|speaker:0|>Hi. <|speaker:1|>Hello."], reference_id=["speaker-a", "speaker-a"],
                             **greedy(max_new_tokens=6))
        assert fin == {"event": "finish", "reason": "stop"} and audio
    srv.wait_idle()


def test_voice_prompt_prefilled_at_start(srv: LiveServer, ref_wav: bytes) -> None:
    """The voice is prefilled the moment a session starts, before any text: its stream's KV holds the voice prompt
    while the client has sent only `start`."""
    srv.wait_idle()
    with srv.connect() as ws:
        ws.send(start_msg(references=[{"audio": ref_wav, "text": REF_TEXT}], **greedy(max_new_tokens=4)))
        deadline = time.monotonic() + 30
        while not any(st.voice_len > 0 for st in list(srv.rt.scheduler.streams.values())):
            assert time.monotonic() < deadline, "no stream prefilled its voice before any text"
            time.sleep(0.01)
        ws.send(text_msg("Now the text."))
        ws.send(STOP)
        events, fin = until_finish(ws)
        assert fin["reason"] == "stop" and events
    srv.wait_idle()


def test_a_deleted_voice_is_not_reused_by_an_open_socket(srv: LiveServer, ref_wav: bytes) -> None:
    """A socket keeps its prefilled voice for the next session with the same reference_id, but not once that voice
    was deleted (or overwritten: the stored voice's version is part of the match)."""
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        assert h.post("/v1/references/add", data={"id": "fleeting", "text": REF_TEXT},
                      files={"audio": ("a.wav", ref_wav)}).status_code == 200
        with srv.connect() as ws:
            assert session(ws, ["Hi."], reference_id="fleeting", **greedy(max_new_tokens=2))[1]["reason"] == "stop"
            assert h.request("DELETE", "/v1/references/delete", json={"id": "fleeting"}).status_code == 200
            ws.send(start_msg(reference_id="fleeting"))
            expect_error(ws, "unknown reference_id", "fleeting")
    srv.wait_idle()
