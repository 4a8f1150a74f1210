"""Ray Serve platform: gateway, KV-aware router, app builder."""
