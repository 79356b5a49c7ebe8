"""Test helpers: a real nats-server fixture, a raw NATS wire client."""
