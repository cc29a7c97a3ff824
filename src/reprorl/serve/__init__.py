"""The vLLM-compatible generation server: a batch-invariant engine (scheduler, KV slots, prefix
cache, adapter stacking, sampling), vLLM's log-prob semantics, the HTTP API, its client and
weight loading. `reprorl serve` runs it and imports no trainer code."""
