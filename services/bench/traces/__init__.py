"""Azure LLM inference traces (2023) shipped as package data; see ATTRIBUTION.md (CC BY 4.0)."""
