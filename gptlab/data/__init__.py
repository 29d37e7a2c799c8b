"""Data: text in (`prepare`), token windows out (`dataset`), and public corpora fetched by name (`corpora`).

No torch here: tokenizer worker processes and `gptlab prepare` start fast.
"""

from gptlab.data.corpora import fetch_shakespeare
from gptlab.data.dataset import check_split_fits, global_batch, load_split, micro_batch, read_meta
from gptlab.data.preparation import prepare

__all__ = ["check_split_fits", "fetch_shakespeare", "global_batch", "load_split", "micro_batch", "prepare",
           "read_meta"]
