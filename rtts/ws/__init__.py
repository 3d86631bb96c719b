"""The network edge: the Fish Audio compatible WebSocket and HTTP API (Starlette on uvicorn)."""
