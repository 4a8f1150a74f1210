"""The serving engine: paged KV cache, scheduler, model runner. Imports no Ray."""
