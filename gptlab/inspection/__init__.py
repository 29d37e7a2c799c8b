"""Look inside a GPT: attention weights (`attention`), the forward pass as a table of shapes, parameters and FLOPs
(`trace`), the logit lens (`lens`), a run's training curves (`curves`) and pictures of all of these (`pictures`,
matplotlib from the `viz` extra, imported only when a picture is drawn).

The CLI (`gptlab attention | trace | lens | plot`) and the server's web page (`gptlab.serve.ui`) call these.
"""

from gptlab.inspection.attention import AttentionMap, attention_map, encode_prompt, token_labels
from gptlab.inspection.curves import Curve, read_curves
from gptlab.inspection.lens import LensResult, logit_lens
from gptlab.inspection.trace import TraceRow, causal_mask_text, format_trace, trace

__all__ = [
    "AttentionMap", "attention_map", "encode_prompt", "token_labels",
    "Curve", "read_curves",
    "LensResult", "logit_lens",
    "TraceRow", "causal_mask_text", "format_trace", "trace",
]
