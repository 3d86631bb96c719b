"""rtts: real-time text-to-speech server for Fish Speech DualAR models."""

__version__ = "0.1.0"
