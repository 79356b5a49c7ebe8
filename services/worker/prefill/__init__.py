"""The prefill role: queue, prefix steps, decode admission from the prefill side, hand-off."""
