"""The serving engine: paged KV cache, scheduler, model runner. Imports no Ray.

Importing it asks torch's CPU allocator for transparent huge pages (``THP_MEM_ALLOC_ENABLE``,
read once, at torch's first CPU allocation; a value already set is kept): see
:mod:`kvharbor.engine.host_memory`, "Huge pages".
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
