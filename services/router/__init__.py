"""FluidPD router: OpenAI-compatible HTTP API over the NATS bus (no torch here).

Run with ``python -m services.router``; embed with ``async with Router(RouterConfig(...))``.
"""
