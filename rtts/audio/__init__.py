"""Audio in and out: decoding uploaded/reference audio, resampling, encoding streamed PCM."""
