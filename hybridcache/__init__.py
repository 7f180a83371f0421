"""hybridcache: a prefix cache and inference engine for hybrid language models."""
