"""Checkpoint-making tools: random-weight checkpoints in the release layout (and their tokenizers), `rtts quantize`,
and a streaming safetensors writer. They build on the model layer; the model layer never imports them."""
