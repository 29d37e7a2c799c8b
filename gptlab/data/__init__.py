"""Data: text and records in (`prepare`), token windows and loss masks out (`dataset`), and public corpora fetched
by name (`corpora`).

No torch here: tokenizer worker processes and `gptlab prepare` start fast.
"""

from gptlab.data.corpora import fetch_shakespeare
from gptlab.data.dataset import (
    batch_starts,
    check_split_fits,
    global_batch,
    load_mask,
    load_split,
    micro_batch,
    read_meta,
    windows,
)
from gptlab.data.preparation import prepare

__all__ = ["batch_starts", "check_split_fits", "fetch_shakespeare", "global_batch", "load_mask", "load_split",
           "micro_batch", "prepare", "read_meta", "windows"]
