"""Serving benchmark: vLLM servers x LLMPerf-protocol load (see bench/README.md)."""
