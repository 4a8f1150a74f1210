"""Ray actors: the LLMReplica deployment and the PrefixDirectory."""
