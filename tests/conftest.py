import os
import tempfile

# The built-in model is written once per test session into a private folder, never into ~/.cache.
os.environ.setdefault("HYBRIDCACHE_HOME", tempfile.mkdtemp(prefix="hybridcache-test-home-"))
os.environ.setdefault("HYBRIDCACHE_DEBUG", "1")  # the engine checks the cache whenever it goes idle
