"""Training recipe for the embedded demo voice (docs/demo_voice.md).

One module per concern, one command per stage (`python -m rtts.train STAGE ...`):

- `data`: sentences (Debian fortunes, WordNet examples, FreeBSD fortunes) spoken by flite `cmu_us_rms`, phone timings
  kept (`sentences.py`, `flite.py`, `dataset.py`);
- `codec`: the server's ModifiedDAC `Codec` class with small sizes, trained with mel/STFT/VQ losses
  (`codec_train.py`, `codec_losses.py`, `vq.py`);
- `tokens`: every utterance encoded by the trained codec (`tokens.py`);
- `dualar`: the server's `DualARTransformer` trained on exactly the prompt layout the server feeds (`sequences.py`,
  `dualar_forward.py`, `dualar_train.py`);
- `export`: the S2 on-disk checkpoint the server loads like any other (`export.py`);
- `evaluate`: Whisper tiny.en (CTranslate2) WER/CER of the source voice or of a checkpoint served through the live
  WebSocket (`whisper.py`, `wer.py`, `evaluate.py`).

Every training stage checkpoints and resumes (`state.py`), splitting files so none exceeds 16 MB.
"""
