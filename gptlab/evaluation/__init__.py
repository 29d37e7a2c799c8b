"""Evaluation: how well a model predicts text, two ways.

    loss     loss, perplexity and bits per byte over a whole split of a prepared data directory (`gptlab eval RUN
             --data DIR`, and the trainer's validation loss), split across a run's processes
    harness  the lm-eval-harness adapter: gptlab models as lm-eval's "gptlab" model (`gptlab eval RUN --tasks ...`,
             `python -m gptlab.evaluation.harness ...`)

The two sit at different heights of the pipeline (training and generation use `loss`; `harness` uses generation),
so this package imports neither: import the module you need.
"""
