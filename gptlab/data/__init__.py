"""Data: text and records in (`prepare`), token windows and loss masks out (`dataset`), and public corpora fetched
by name (`corpora`).

No torch here: tokenizer worker processes and `gptlab prepare` start fast. `prepare` and `fetch_shakespeare`
import their modules on first use, so a training run, which only reads prepared data, never loads the encoding
pool, the record readers or an HTTP client.
"""

from gptlab.data.dataset import (
    batch_starts,
    check_split_fits,
    document_end_id,
    global_batch,
    load_mask,
    load_split,
    micro_batch,
    read_meta,
    windows,
)
from gptlab.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"fetch_shakespeare": "gptlab.data.corpora",
                                               "prepare": "gptlab.data.preparation"})

__all__ = ["batch_starts", "check_split_fits", "document_end_id", "fetch_shakespeare", "global_batch", "load_mask",
           "load_split", "micro_batch", "prepare", "read_meta", "windows"]
